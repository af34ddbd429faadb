"""The cost model of ``zerotron plan`` (:mod:`zerotron.analysis.planner`): predicted memory and step time
of a layout (dp, tp, pp, ZeRO stage, schedule, micro-batch, recompute) of a GPT-2 or Llama model on G
GPUs, priced by :func:`zerotron.analysis.layout_cost.evaluate`. Pure arithmetic: nothing is
allocated. The model enters through :class:`zerotron.analysis.flops.Shape` (GQA's k/v width,
SwiGLU's three matrices, norms, tied or untied head).

Memory per GPU (bytes), max over pipeline ranks = model states (ZeRO paper, bf16-mixed + Adam,
K = 12, on that rank's parameters per tp rank: ``memory.stage_num_params``) + activations
(``activations.activation_bytes``, bf16, Korthikanti et al. 2022) + a fixed framework overhead
(CUDA context, NCCL buffers, allocator slack: 2 GB, ``--overhead``). Not counted: ZeRO-3's
gathered layer, temporaries, fragmentation beyond the overhead.

Step time (seconds), after Narayanan et al. 2021 (Megatron-LM, PTD-P) section 3, per micro-batch
of b sequences of S tokens on pipeline rank r (h = n_embd, V = vocab, a = n_head):
* matmuls: FLOPs / (peak FLOP/s x ``compute_eff``): per token and layer 6W + 12hS (PaLM
  appendix B; W = the block's matmul weights, :meth:`Shape.block_matmul_params`: 12h^2 for GPT-2,
  2h^2 + 2h*H_kv*D + 3hF for Llama), the output layer 6hV on the last stage, divided by tp;
  recomputation adds one forward: full 2(W - hF) + 4hS, selective 2(h^2 + 2hH_kvD) + 4hS (the
  q/k/v projections and the attention) per token and layer (torch's checkpoint does not re-run a
  sub-layer's last matmul: :func:`zerotron.analysis.flops.recompute_flops`).
* elementwise ("vector") work at ``hw.vector_rate`` element passes/s (roofline's memory-bound
  side): per token and layer, forward + backward, 2 layer norms 4h, the activation 2F (GELU,
  F = 4h: 8h) or 4F (SwiGLU: silu and the gating product) (/tp: it follows the column-parallel
  matmuls), residual adds 2h; layer norms and residuals are replicated over tp
  unless sequence parallel splits them (Korthikanti et al. 2022, section 4.2.2); full recompute
  adds their forward again; "math" attention adds the softmax 2aS/tp; the last stage adds the
  cross-entropy's softmax 2V/tp.
* collectives follow the alpha-beta model (:func:`zerotron.analysis.hardware.collective_time`:
  alpha seconds per call + bytes x nccl-tests factor / busbw), on the link the group crosses;
  every call also pays ``hw.sync_penalty`` (the measured cost of a collective that follows
  compute; 0 on GPUs).
  tp: the blocking collectives of :func:`zerotron.analysis.comm_messages.tp_messages` (per layer 2 row-parallel outputs forward
  and one input gradient per column-parallel Linear backward -- 2 for GPT-2, 5 for Llama --; with
  SP all-gather / reduce-scatter pairs; full recompute re-runs one row-parallel output; the
  vocab-parallel embedding, the head's input gradient and the loss), checked equal to what the
  code sends by dry runs (tests/test_dryrun_planbytes.py). Activations cross in the residual
  stream's dtype (:func:`~zerotron.analysis.comm_messages.stream_bytes`: fp32 under bf16 over ZeRO-0's fp32 parameters), matmul
  outputs in ``elem_bytes``.
  pp: per chunk one activation (forward) and one gradient (backward) of b*S*h (/tp with SP), in
  the stream's dtype. Neither is overlapped.
* pipeline: step = m x max_r(t_r) + (sum_r t_r - max_r t_r) / v for per-micro-batch stage times
  t_r: the slowest stage runs all m micro-batches, and the fill and drain pass once through each
  other stage (in chunks of 1/v with interleaving, v = 2). With equal stages this is the bubble
  fraction (p-1)/(v*m + p-1) of Narayanan et al. 2021
  (:func:`zerotron.parallel.pipeline.simulation.bubble_theory`); with unequal ones (e.g. the output layer on
  the last stage) the fill and drain are shorter.
* dp on the gradients/parameters of the largest rank (Psi_r elements), in units of one
  transformer block (plus the embedding/output "root" on the first/last stage), the messages the
  code sends (:func:`~zerotron.analysis.comm_messages.dp_messages`, the same rule as :func:`~zerotron.analysis.comm_messages.comm_bytes`): gradient reductions in
  ``reduce_bytes`` per element (``parallel.reduce_dtype``: fp32 under bf16 by default), parameter
  all-gathers in ``elem_bytes``; ZeRO-0 one bucketed all-reduce (ceil(bytes / ``bucket_bytes``)
  calls); ZeRO-1 a reduce-scatter + an all-gather per unit per step; ZeRO-2 a reduce-scatter per
  unit and micro-batch + one all-gather per unit; ZeRO-3 per unit and micro-batch two all-gathers
  + one reduce-scatter (the ZeRO paper's 1.5x of plain DP, per micro-batch), native ZeRO-3's root
  unit gathered once per step (FSDP2, ``layout["zero_impl"]``: 2m). Native ZeRO sends each of
  these per flat buffer of the unit (its weight-decay and no-decay, tp-sharded and replicated
  parameters apart: :func:`~zerotron.analysis.comm_messages.dp_flat_calls`, e.g. 2 per Llama block), FSDP2 one per unit. A fraction ``hw.overlap`` of it hides behind
  the backward compute (at most the backward's 2/3 of the compute): exposed = t_dp -
  min(overlap x t_dp, backward). ``overlap`` = 0 (the default) is an upper bound.
* HSDP (``dp_replicate`` R, priced where dp x tp spans nodes, with R = dp x tp / gpus_per_node so
  each shard group x tp fills a node): model states sharded over S = dp / R; the ZeRO collectives
  above over S ranks on the intra-node link plus one all-reduce of the 1/S gradient shard across
  the R replicas on the inter-node link per unit and step (ZeRO-0: reduce-scatter + all-gather
  over S, all-reduce of 1/S over R per bucket).
* expert parallelism (``ep`` > 1, mixture-of-experts models; the plan's rules: ep divides
  n_experts and the batch degree dp x cp -- the shard degree dp/R x cp under HSDP -- and a
  pipeline takes ep without HSDP only): each MoE layer's E experts split over ep ranks carved out
  of the batch group dp x cp (``parallel.expert``; under a pipeline per stage). Model states
  (``analysis.moe_memory.moe_state_bytes``, what ``zerotron memory --ep`` reports): the dense
  parameters under the ZeRO formula over dp x cp, the rank's E/ep experts under it over the
  (dp x cp)/ep ranks that hold the same experts (native ZeRO's expert flat buffers; HSDP: / R).
  dp time: the dense gradients' collectives over dp x cp plus the local experts' over (dp x cp)/ep
  (the same link: an expert-replica group spans the shard group's block). The token all-to-all
  (``analysis.moe_memory.moe_all_to_all_bytes``): per layer and micro-batch 4 exchanges (dispatch and
  combine, forward and backward; 6 with full recomputation) of b*S/cp*k*C elements (/ tp with
  SP) plus the E int64 counts of each forward, priced as an all-gather of those bytes on the ep
  group (ep consecutive batch ranks x tp; an all-to-all moves (n-1)/n of its buffer per rank, the
  all-gather's factor), on the critical path.
* a per-layer, per-micro-batch launch overhead (``launch_s``, 20 us), so larger micro-batches win.
* offload (``train.offload``; only with a host link, ``host_link`` bytes/s per direction, e.g.
  ``hardware.HOST_LINKS``; proposed only for layouts that do not fit without it): the device holds
  ``memory.model_state_bytes(offload=...)``; per step the host link carries, per shard element of
  the largest rank, optimizer offload (ZeRO-1/2/3) the fp32 gradient shard to the host (4 bytes) and
  the updated bf16 shard back (2), params offload (ZeRO-3) the gradient shard (4) and the bf16 shard
  of every all-gather (2 per micro-batch forward and backward: 4m), not overlapped (``host_comm``).
  The host's optimizer step itself is not priced.
Links: ranks are ordered (pp, dp, tp), tp innermost, nodes hold ``gpus_per_node`` consecutive
ranks. A group uses the intra-node link (NVLink) iff it fits in aligned node-local blocks, else the
inter-node link (one NIC per GPU). Hardware (:mod:`zerotron.analysis.hardware`): datasheet values
x ``comm_eff``, or, with ``--calibrate``, alpha, busbw and overlap measured by a ``zerotron bench
comm --json`` run for the intra-node link. MFU = (6N + 12LhS) x tokens / (step time x G x peak),
N = :meth:`Shape.flop_params` (an untied token embedding is a lookup, not counted).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zerotron.analysis.comm_messages import default_reduce_bytes, dp_messages
from zerotron.analysis.hardware import GB, Hardware, collective_time


@dataclass(frozen=True)
class CostModel:
    """Options of the cost model (module docstring): hardware, ``gpus_per_node``, achieved/peak
    FLOP/s ``compute_eff``, framework ``overhead`` bytes per GPU, ``attention`` kernel ("flash":
    SDPA on GPUs, no s^2 activations; "math": Korthikanti's count), sequence parallelism ``sp``
    whenever tp > 1, ``launch_s`` seconds per layer and micro-batch, ``elem_bytes`` per
    communicated activation/gradient element (2: bf16; 4: fp32 training, e.g. on CPU) and the
    data-parallel ``bucket_bytes`` (25 MiB, torch DDP's default), ``reduce_bytes`` per element of
    the gradient reductions (``parallel.reduce_dtype``; None: :func:`~zerotron.analysis.comm_messages.default_reduce_bytes`, fp32 under
    bf16 as the code's "auto"); the process-group ``backend``
    ("nccl" on GPUs: zb-v is not proposed there, the runner refuses it; "gloo"). Memory is always
    priced in bf16-mixed (module docstring)."""
    hw: Hardware
    gpus_per_node: int = 8
    compute_eff: float = 0.5
    overhead: int = 2 * GB
    attention: str = "flash"
    sp: bool = False
    launch_s: float = 20e-6
    elem_bytes: int = 2
    bucket_bytes: int = 25 << 20
    backend: str = "nccl"
    host_link: float = 0.0  # bytes/s per direction of the device-host link; 0: offload not priced
    reduce_bytes: int | None = None  # per gradient-reduction element; None: default_reduce_bytes(elem_bytes)


def host_bytes(offload: str, shard: int, m: int) -> int:
    """Bytes one rank moves over the host link per step for ``offload`` ("none", "optimizer",
    "params") with ``shard`` trainable shard elements and ``m`` micro-batches (module docstring:
    4 + 2 bytes per element for optimizer offload, 4 + 4m for params offload, bf16-mixed)."""
    return {"none": 0, "optimizer": 6 * shard, "params": (4 + 4 * m) * shard}[offload]


def link_model(hw: Hardware, intra: bool) -> tuple[dict, dict]:
    """(busbw, latency + sync penalty) per op of the intra- or inter-node link."""
    bw, lat = (hw.intra, hw.latency_intra) if intra else (hw.inter, hw.latency_inter)
    return bw, {op: v + hw.sync_penalty for op, v in lat.items()}


def dp_time(z: int, m: int, calls: int, params: float, dp: int, link, cm: "CostModel", rep: int = 1,
             rep_link=None, root: float = 0, fsdp2: bool = False, root_calls: int = 1) -> float:
    """Seconds of one step's data-parallel collectives (module docstring), not yet overlapped: the
    messages of :func:`~zerotron.analysis.comm_messages.dp_messages` for ``params`` parameters (``root`` of them in the root units;
    ``calls`` collectives per sweep over the units, ``root_calls`` of them the root units')
    at ``cm.elem_bytes`` (gathers) and ``cm.reduce_bytes`` (reductions; ZeRO-0's all-reduce in
    ceil(bytes / ``cm.bucket_bytes``) calls) over ``dp`` ranks on ``link``.
    HSDP (``rep`` = R > 1 replicas): the ZeRO collectives run over the S = dp / R shard group on
    ``link``, plus one all-reduce of the gradient's 1/S shard across the R replicas on ``rep_link``
    per flat (ZeRO-0: per bucket) and step; ZeRO-0 (hierarchical DDP): reduce-scatter + all-gather
    of the gradient over S, all-reduce of its 1/S over R."""
    red = cm.reduce_bytes or default_reduce_bytes(cm.elem_bytes)
    grad = red * params
    buckets = math.ceil(grad / cm.bucket_bytes)
    if rep > 1:
        s = dp // rep
        across = collective_time(grad / s, "all_reduce", rep, *rep_link, calls=calls if z else buckets)
        if z == 0:
            return (collective_time(grad, "reduce_scatter", s, *link, calls=buckets)
                    + collective_time(grad, "all_gather", s, *link, calls=buckets) + across)
        return dp_time(z, m, calls, params, s, link, cm, root=root, fsdp2=fsdp2, root_calls=root_calls) + across
    return sum(collective_time(nbytes, op, dp, *link, calls=buckets if z == 0 else n)
               for op, nbytes, n, _ in dp_messages(z, m, calls, params, root, cm.elem_bytes, red, fsdp2, root_calls))


def exposed_dp(t_dp: float, compute: float, overlap: float) -> float:
    """The data-parallel seconds left on the critical path: ``t_dp`` less the fraction ``overlap``
    of it that hides behind the backward (at most the backward's 2/3 of the step's ``compute``
    seconds): t_dp - min(overlap x t_dp, 2/3 compute)."""
    return t_dp - min(overlap * t_dp, compute * 2 / 3)
