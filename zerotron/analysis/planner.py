"""``zerotron plan``: rank (dp, tp, pp, ZeRO stage, schedule, micro-batch, recompute) layouts of a
GPT-2 or Llama model on G GPUs by predicted memory and step time. Pure arithmetic: nothing is
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
  sub-layer's last matmul: :func:`recompute_flops`).
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
  tp: the blocking collectives of :func:`tp_messages` (per layer 2 row-parallel outputs forward
  and one input gradient per column-parallel Linear backward -- 2 for GPT-2, 5 for Llama --; with
  SP all-gather / reduce-scatter pairs; full recompute re-runs one row-parallel output; the
  vocab-parallel embedding, the head's input gradient and the loss), checked equal to what the
  code sends by dry runs (tests/test_dryrun_planbytes.py). Activations cross in the residual
  stream's dtype (:func:`stream_bytes`: fp32 under bf16 over ZeRO-0's fp32 parameters), matmul
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
  code sends (:func:`dp_messages`, the same rule as :func:`comm_bytes`): gradient reductions in
  ``reduce_bytes`` per element (``parallel.reduce_dtype``: fp32 under bf16 by default), parameter
  all-gathers in ``elem_bytes``; ZeRO-0 one bucketed all-reduce (ceil(bytes / ``bucket_bytes``)
  calls); ZeRO-1 a reduce-scatter + an all-gather per unit per step; ZeRO-2 a reduce-scatter per
  unit and micro-batch + one all-gather per unit; ZeRO-3 per unit and micro-batch two all-gathers
  + one reduce-scatter (the ZeRO paper's 1.5x of plain DP, per micro-batch), native ZeRO-3's root
  unit gathered once per step (FSDP2, ``layout["zero_impl"]``: 2m). Native ZeRO sends each of
  these per flat buffer of the unit (its weight-decay and no-decay, tp-sharded and replicated
  parameters apart: :func:`dp_flat_calls`, e.g. 2 per Llama block), FSDP2 one per unit. A fraction ``hw.overlap`` of it hides behind
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
  (``analysis.memory.moe_state_bytes``, what ``zerotron memory --ep`` reports): the dense
  parameters under the ZeRO formula over dp x cp, the rank's E/ep experts under it over the
  (dp x cp)/ep ranks that hold the same experts (native ZeRO's expert flat buffers; HSDP: / R).
  dp time: the dense gradients' collectives over dp x cp plus the local experts' over (dp x cp)/ep
  (the same link: an expert-replica group spans the shard group's block). The token all-to-all
  (``analysis.memory.moe_all_to_all_bytes``): per layer and micro-batch 4 exchanges (dispatch and
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
from functools import lru_cache
from itertools import product

from zerotron.analysis.activations import activation_bytes, looped_counts, stage_layer_counts
from zerotron.analysis.bubble import NCCL_REFUSED, PIPELINE_KINDS, pipeline_idle
from zerotron.analysis.flops import Shape, shape_of
from zerotron.analysis.hardware import GB, Hardware, collective_time
from zerotron.analysis.memory import model_state_bytes, moe_all_to_all_bytes, moe_state_bytes, stage_num_params
from zerotron.models.layout import tp_refusal

SCHEDULE_ORDER = ("none", "1f1b", "interleaved", "gpipe", "zb-h1", "zb-v")
RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class CostModel:
    """Options of the cost model (module docstring): hardware, ``gpus_per_node``, achieved/peak
    FLOP/s ``compute_eff``, framework ``overhead`` bytes per GPU, ``attention`` kernel ("flash":
    SDPA on GPUs, no s^2 activations; "math": Korthikanti's count), sequence parallelism ``sp``
    whenever tp > 1, ``launch_s`` seconds per layer and micro-batch, ``elem_bytes`` per
    communicated activation/gradient element (2: bf16; 4: fp32 training, e.g. on CPU) and the
    data-parallel ``bucket_bytes`` (25 MiB, torch DDP's default), ``reduce_bytes`` per element of
    the gradient reductions (``parallel.reduce_dtype``; None: :func:`default_reduce_bytes`, fp32 under
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


def _link(hw: Hardware, intra: bool) -> tuple[dict, dict]:
    """(busbw, latency + sync penalty) per op of the intra- or inter-node link."""
    bw, lat = (hw.intra, hw.latency_intra) if intra else (hw.inter, hw.latency_inter)
    return bw, {op: v + hw.sync_penalty for op, v in lat.items()}


@lru_cache(maxsize=4096)
def _activations(shape: Shape, *args) -> dict:
    b, seq, tp, sp, pp, kind, m, v, recompute, attention = args
    return activation_bytes(shape, b, seq, tp=tp, sp=sp,
                            pp=pp, schedule="1f1b" if kind == "none" else kind, microbatches=m,
                            virtual_stages=v, recompute=recompute, dtype="bf16",
                            attention=attention)


def dp_flat_calls(shape: Shape, tp: int, blocks: int, first: bool, last: bool, pipeline: bool) -> tuple[int, int]:
    """Collectives of one sweep over a rank's native ZeRO units (``(all units', root units')``): the
    code sends one per flat buffer, and ``parallel.data.flat_shard.build_flats`` makes one flat per
    (weight-decay flag, tp-sharded) class present in a unit (``parallel.optim.decay_mask``: Linear
    weights decay; biases, norms and embeddings do not; under tp > 1 the matrices, column-parallel
    biases and the vocab-parallel embedding / head are sharded, norms and row-parallel biases
    replicated). Units: each of the rank's ``blocks`` blocks; the root -- the embeddings where the
    rank holds the first stage, the final norm and an untied head where it holds the last -- as
    one unit on the plain runner, and under a ``pipeline`` a tied embedding/head as a unit of its
    own (``pipeline.runner``; never decayed) beside the other root parameters. A MoE block's
    router (and its experts, at ep 1) are replicated matrices: one more class under tp > 1.
    Checked equal to the traced calls by tests/test_dryrun_planbytes.py."""
    sh = tp > 1
    block = {(True, sh), (False, False)} | ({(False, sh)} if shape.bias else set()) | (
        {(True, False)} if shape.n_experts else set())
    wte, wpe, norm, head = (False, sh), (False, False), (False, False), (True, sh)
    embed = [wte] + ([wpe] if shape.learned_positions else []) if first else []
    tail = [norm] + ([] if shape.tied else [head]) if last else []
    if pipeline and shape.tied and (first or last):  # the tied weight alone, then the rest
        units = [{wte}, set(([wpe] if first and shape.learned_positions else []) + ([norm] if last else []))]
    else:  # one root unit (the plain runner's tied head is the embedding: counted once)
        units = [set(embed + tail)]
    root = sum(len(u) for u in units)
    return blocks * len(block) + root, root


def dp_messages(z: int, m: int, calls: int, params: int, root: int, elem_bytes: int, reduce_bytes: int,
                fsdp2: bool = False, root_calls: int = 1) -> list[tuple[str, int, int, str]]:
    """One step's data-parallel collectives of a rank holding ``params`` parameters (``root`` of them
    in the root units -- embeddings, final norm, head -- where the rank holds any), whose units take
    ``calls`` collectives per sweep, ``root_calls`` of them the root units' (native ZeRO: one per
    flat buffer, :func:`dp_flat_calls`; FSDP2: one per unit), as the code sends them: ``[(op, total
    bytes, calls, kind), ...]``, bytes in the nccl-tests size convention of ``comm.STATS``
    (all-gather: output, reduce-scatter: input), kind "reduce" (gradients, ``reduce_bytes`` per
    element: ``parallel.reduce_dtype``) or "gather" (parameters, ``elem_bytes``: the compute copy).
    ZeRO-0 one all-reduce of the gradients; ZeRO-1 a reduce-scatter sweep + an all-gather sweep;
    ZeRO-2 a reduce-scatter sweep per micro-batch + an all-gather sweep; ZeRO-3 per micro-batch a
    reduce-scatter sweep and two all-gathers (forward, backward) of every block, native ZeRO-3's
    root units gathered once per step (``parallel.data.zero`` keeps them for the step), FSDP2's
    (``fsdp2``) like a block (2m). The bucketing of ZeRO-0 is the caller's (calls = 1 here). The
    one rule for :func:`comm_bytes` (bytes) and :func:`evaluate` (seconds)."""
    grad, gather = reduce_bytes * params, elem_bytes * params
    if z == 0:
        return [("all_reduce", grad, 1, "reduce")]
    if z == 1:
        return [("reduce_scatter", grad, calls, "reduce"), ("all_gather", gather, calls, "gather")]
    if z == 2:
        return [("reduce_scatter", m * grad, m * calls, "reduce"), ("all_gather", gather, calls, "gather")]
    once = 0 if fsdp2 or not root else 1  # native ZeRO-3 gathers the root units once per step
    return [("reduce_scatter", m * grad, m * calls, "reduce"),
            ("all_gather", 2 * m * gather - (2 * m - 1) * elem_bytes * root * once,
             2 * m * (calls - once * root_calls) + once * root_calls, "gather")]


def default_reduce_bytes(elem_bytes: int) -> int:
    """Bytes per element of the gradient reductions with ``parallel.reduce_dtype = "auto"``
    (``parallel.precision.reduce_dtype``: the parameter dtype): fp32 (4) under bf16 training
    (``elem_bytes`` 2: autocast over fp32 parameters), else ``elem_bytes``."""
    return max(4, elem_bytes)


def _dp_time(z: int, m: int, calls: int, params: float, dp: int, link, cm: "CostModel", rep: int = 1,
             rep_link=None, root: float = 0, fsdp2: bool = False, root_calls: int = 1) -> float:
    """Seconds of one step's data-parallel collectives (module docstring), not yet overlapped: the
    messages of :func:`dp_messages` for ``params`` parameters (``root`` of them in the root units;
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
        return _dp_time(z, m, calls, params, s, link, cm, root=root, fsdp2=fsdp2, root_calls=root_calls) + across
    return sum(collective_time(nbytes, op, dp, *link, calls=buckets if z == 0 else n)
               for op, nbytes, n, _ in dp_messages(z, m, calls, params, root, cm.elem_bytes, red, fsdp2, root_calls))


def recompute_flops(shape: Shape, S: int, recompute: str) -> float:
    """FLOPs per token and layer that recomputation adds (``parallel.recompute``): none 0;
    selective 2(h^2 + 2h H_kv D) + 4hS, the attention sub-layer's q/k/v projections and the
    attention (scores and values) again; full 2(W - hF) + 4hS, the whole block again but its last
    matmul (the MLP's down projection, h x F). Neither re-runs its sub-layer's last matmul (the
    output projection, the down projection): torch's non-reentrant checkpoint stops recomputing as
    soon as the tensors the backward saved are rebuilt (its early stop), and no backward needs that
    matmul's output (found by the dry run's FLOP count, ``tests/test_dryrun.py``)."""
    h = shape.n_embd
    attn = 2 * (h * h + 2 * h * shape.kv_dim) + 4 * h * S
    full = 2 * (shape.block_matmul_params() - h * shape.ffn) + 4 * h * S
    return {"none": 0, "selective": attn, "full": full}[recompute]


def m_flops(shape: Shape, b: int, S: int, layers: int, last: bool, tp: int, recompute: str) -> float:
    """Matmul + attention FLOPs of one micro-batch (``b`` sequences of ``S`` tokens) on a pipeline
    rank holding ``layers`` transformer blocks (and the output layer if ``last``), forward +
    backward, per tp rank (module docstring: 6W + 12hS per token and layer, PaLM appendix B;
    recomputation adds 2W + 4hS (full) or 4hS (selective); the output layer 6hV). The figure a
    dry run's FLOP counter reads off the traced step (``zerotron.analysis.trace_time``)."""
    h, W = shape.n_embd, shape.block_matmul_params()
    extra = recompute_flops(shape, S, recompute)
    return b * S * (layers * (6 * W + 12 * h * S + extra) + (6 * h * shape.vocab_size if last else 0)) / tp


def pipeline_time(stage_times: list[float], m: int, kind: str, v: int, split: tuple) -> float:
    """Seconds of the pipelined part of a step: ``m`` micro-batches through stages that take
    ``stage_times`` seconds per micro-batch each (all chunks of a rank), schedule ``kind``
    ("none" or one of ``PIPELINE_KINDS``) with ``v`` chunks per rank: m x max_r t_r + (sum_r t_r -
    max_r t_r) x rel, where rel is the schedule's idle (:func:`zerotron.analysis.bubble.pipeline_idle`
    at the F : B : W cost ``split`` of a layer) relative to 1F1B's (p-1)(T_F+T_B+T_W): the
    slowest stage runs all m micro-batches, the fill and drain pass once through the others
    (module docstring, Narayanan et al. 2021). One stage: m x t_0."""
    pp, stage = len(stage_times), max(stage_times)
    if pp == 1:
        return m * stage
    rel = pipeline_idle(pp, m, kind, v, *split) / ((pp - 1) * sum(split))
    return m * stage + (sum(stage_times) - stage) * rel


def ring_messages(shape: Shape, b: int, S: int, cp: int, recompute: str, elem_bytes: int) -> dict:
    """Point-to-point messages each cp rank sends per layer and micro-batch under ring attention
    (``parallel.context.ring``; Liu et al. 2023): forward cp - 1 hops of its K/V block (once more
    when recomputation re-runs the attention), backward cp - 1 hops of K/V and cp hops of the dK/dV
    accumulators. A K/V message is 2 x b x (S/cp) x H_kv*D elements of ``elem_bytes``; the
    accumulators are fp32 under bf16 (``elem_bytes`` 2), else ``elem_bytes``. Returns ``{"kv":
    count, "dkv": count, "kv_bytes": bytes each, "dkv_bytes": bytes each}`` (all 0 for cp = 1)."""
    if cp == 1:
        return {"kv": 0, "dkv": 0, "kv_bytes": 0, "dkv_bytes": 0}
    n = 2 * b * (S // cp) * shape.kv_dim
    again = recompute in ("full", "selective")
    return {"kv": (cp - 1) * (2 + again), "dkv": cp, "kv_bytes": n * elem_bytes,
            "dkv_bytes": n * (4 if elem_bytes == 2 else elem_bytes)}


def stream_bytes(elem_bytes: int, zero_stage: int) -> int:
    """Bytes per element of the residual stream (embedding output, norms, each block's input and
    input gradient) under training dtype ``elem_bytes`` (2: bf16): bf16 training over fp32
    parameters (ZeRO-0: DDP, tp/pp without ZeRO) runs under autocast, which casts only the
    matmuls, so the stream stays fp32 (4) and only matmul outputs are bf16; ZeRO >= 1 and FSDP2
    compute on bf16 parameter copies, so the stream is bf16 too. Otherwise ``elem_bytes``.
    The rule :func:`zerotron.analysis.activations.activation_bytes` applies (``bf16_params``)."""
    return 4 if elem_bytes == 2 and zero_stage == 0 else elem_bytes


def tp_messages(shape: Shape, tokens: int, sp: bool, recompute: str, elem_bytes: int, stream: int,
                layers: int, first: bool, last: bool) -> list[tuple[str, int, int]]:
    """The tensor-parallel collectives of one micro-batch through one pipeline rank of ``layers``
    blocks (``parallel.tensor``: Megatron's f/g operators, Shoeybi et al. 2019; with SP all-gather
    / reduce-scatter pairs, Korthikanti et al. 2022), as ``(op, bytes per call, calls)`` in the
    nccl-tests size convention (all-gather output, reduce-scatter input: the full (``tokens``, h)
    activation, ``tokens`` = b*S/cp). Element sizes: a row-parallel matmul's output and its
    gradient ``elem_bytes``; a column-parallel Linear's input and input gradient and the
    embedding / head's the residual stream's ``stream`` (:func:`stream_bytes`). Per layer, with
    C = :attr:`Shape.column_linears` (each column-parallel Linear runs its own collective) and
    R = :attr:`Shape.row_linears` (attention out, MLP out: 2 for a dense block):

    * without SP: forward R all-reduces (row outputs), backward C (column input gradients);
    * with SP: forward C all-gathers + R reduce-scatters, backward C reduce-scatters + R all-gathers;
    * full recomputation re-runs the forward's collectives but the MLP's row-parallel one (torch's
      non-reentrant checkpoint stops recomputing once the saved tensors are back: the MLP output
      is not one of them): +1 row all-reduce (attention's); with SP +C all-gathers + 1 reduce-scatter.

    First stage: the vocab-parallel embedding's forward all-reduce (SP: reduce-scatter forward,
    all-gather backward). Last stage: the head's input-gradient all-reduce (SP: all-gather
    forward, reduce-scatter backward) and the vocab-parallel loss's 2 fp32 all-reduces of
    ``tokens`` (max) and 2 x ``tokens`` (sum-exp, target logit) values. Not listed: SP's per-step
    all-reduce of the tp-replicated parameters' gradients (norms, row biases: O(L h) elements) and
    label smoothing's extra loss row."""
    h, C, R = shape.n_embd, shape.column_linears, shape.row_linears
    row, col, full = tokens * h * elem_bytes, tokens * h * stream, recompute == "full"
    if sp:
        out = [("all_gather", col, layers * C * (1 + full)), ("reduce_scatter", row, layers * (R + full)),
               ("reduce_scatter", col, layers * C), ("all_gather", row, layers * R)]
        out += [("reduce_scatter", col, 1), ("all_gather", col, 1)] if first else []
        out += [("all_gather", col, 1), ("reduce_scatter", col, 1)] if last else []
    else:
        out = [("all_reduce", row, layers * (R + full)), ("all_reduce", col, layers * C)]
        out += [("all_reduce", col, 1)] if first else []
        out += [("all_reduce", col, 1)] if last else []
    if last:
        out += [("all_reduce", tokens * 4, 1), ("all_reduce", 2 * tokens * 4, 1)]
    return [x for x in out if x[2]]


def _sweep_calls(shape: Shape, tp: int, layers: int, pp_rank: int, pp: int, fsdp2: bool) -> tuple[int, int]:
    """(collectives per sweep over pipeline rank ``pp_rank``'s units, the root units' share):
    native ZeRO's flats (:func:`dp_flat_calls`), FSDP2 one per unit (each block, the root)."""
    first, last = pp_rank == 0, pp_rank == pp - 1
    if fsdp2:
        return layers + (first or last), int(first or last)
    return dp_flat_calls(shape, tp, layers, first, last, pp > 1)


def exposed_dp(t_dp: float, compute: float, overlap: float) -> float:
    """The data-parallel seconds left on the critical path: ``t_dp`` less the fraction ``overlap``
    of it that hides behind the backward (at most the backward's 2/3 of the step's ``compute``
    seconds): t_dp - min(overlap x t_dp, 2/3 compute)."""
    return t_dp - min(overlap * t_dp, compute * 2 / 3)


def evaluate(cfg, layout: dict, seq: int, global_batch: int, cm: CostModel, memory_limit: int | None = None) -> dict:
    """Predicted memory and step time of ``layout`` (keys dp, tp, pp, zero_stage, schedule
    ("none" for pp = 1), micro_batch, recompute; optional dp_replicate (HSDP), ep (expert parallel,
    MoE models, :func:`_expert_degrees`; the ValueError names the rule otherwise) and cp: context
    parallel with ring attention, each rank S/cp tokens, model states sharded over dp x cp, the
    ring's exposed transfer in ``cp_comm``) for the model of ``cfg`` (a GPT-2/Llama config or a
    :class:`Shape`), ``global_batch`` sequences of
    ``seq`` tokens per step (cost model of the module docstring). Returns the layout plus
    ``microbatches``, ``virtual_stages``, ``sp``, ``memory_bytes_per_gpu`` (bytes),
    ``stage_time_s`` (seconds per micro-batch of each pipeline rank), ``predicted_step_time_s``,
    ``predicted_tokens_per_s``, ``predicted_mfu`` and ``time_breakdown_s`` (seconds per step: compute, vector, overhead, tp_comm, pp_comm of the
    slowest stage x m, ep_comm the token all-to-all; bubble; dp_comm exposed); for a MoE model also
    ``moe``: per pipeline rank ``state_bytes`` and ``expert_state_bytes`` (model states,
    :func:`~zerotron.analysis.memory.moe_state_bytes`) and ``all_to_all_bytes`` per step (0 at ep 1).
    With ``memory_limit`` (bytes), a layout whose memory exceeds it is not priced further: the
    result is then only the layout and ``memory_bytes_per_gpu`` (what :func:`plan` needs to drop it).
    Raises ValueError
    (from the estimators, or for an ep the rules refuse) for an impossible layout."""
    dp, tp, pp, b, z = (layout[k] for k in ("dp", "tp", "pp", "micro_batch", "zero_stage"))
    n_rep = layout.get("dp_replicate", 1)  # HSDP: replicas x (dp / n_rep) shards
    cp = layout.get("cp", 1)  # context parallel: each rank holds S / cp tokens of every sequence
    ep = layout.get("ep", 1)  # expert parallel (MoE): E / ep experts per rank, carved out of dp
    kind, rec, hw, K, sp = layout["schedule"], layout["recompute"], cm.hw, cm.gpus_per_node, cm.sp
    sp = sp and tp > 1
    v = 2 if kind in ("interleaved", "zb-v") else 1
    m = global_batch // (dp * b)
    shape = cfg if isinstance(cfg, Shape) else shape_of(cfg)
    h, L, V, S, a, F = shape.n_embd, shape.n_layer, shape.vocab_size, seq, shape.n_head, shape.ffn
    W = shape.block_matmul_params()
    act = _activations(shape, b, S // cp, tp, sp, pp, kind, m, v, rec, cm.attention)
    counts = looped_counts(stage_layer_counts(L, pp * v), pp, kind)  # index chunk * pp + rank
    params = stage_num_params(shape, tp, pp, v, counts)
    off = layout.get("offload", "none")
    if ep > 1 and ep not in _expert_degrees(shape, dp, pp, cp, n_rep):
        raise ValueError(f"ep ({ep}) needs a mixture-of-experts model and ep dividing n_experts ({shape.n_experts}) "
                         f"and the shard degree dp / dp_replicate x cp ({dp // n_rep} x {cp}), without HSDP under a "
                         "pipeline")
    # expert parameters of each pipeline rank (all E per layer; tp-replicated), of which ep > 1 keeps E/ep
    rank_layers = [sum(counts[c * pp + r] for c in range(v)) for r in range(pp)]
    experts = [n * shape.n_experts * 3 * h * F for n in rank_layers]
    toks = b * S // cp // (tp if sp else 1)  # tokens each rank routes per micro-batch (SP: its sequence shard)
    moe = None
    if shape.n_experts:  # dense over dp x cp, the local experts over the (dp x cp) / ep ranks holding them
        moe = {"state_bytes": [moe_state_bytes(p, e, dp, ep, z, "bf16-mixed", "adam", cp, n_rep, off)
                               for p, e in zip(params, experts)],
               "all_to_all_bytes": [moe_all_to_all_bytes(shape, n, toks, m, cm.elem_bytes, rec) if ep > 1 else 0
                                    for n in rank_layers]}

    def states(r):
        if moe:
            return moe["state_bytes"][r]["total_bytes"]
        return model_state_bytes(params[r], dp * cp, z, "bf16-mixed", "adam", n_rep, offload=off)["total_bytes"]
    mem = max(states(r) + a_ for r, a_ in enumerate(act["per_rank_bytes"])) + cm.overhead
    if memory_limit is not None and mem > memory_limit:  # plan() drops it: no time to price
        return {**layout, "memory_bytes_per_gpu": int(mem)}
    # ranks are ordered (pp, dp, cp, tp), tp innermost: a group fits a node iff its block does
    tp_link = _link(hw, tp <= K and K % tp == 0)
    cp_link = _link(hw, cp * tp <= K and K % (cp * tp) == 0)
    shard = dp // n_rep * cp * tp  # ranks spanned by one (shard-group x cp x tp) block
    dp_link = _link(hw, shard <= K and K % shard == 0)
    rep_link = _link(hw, dp * cp * tp <= K and K % (dp * cp * tp) == 0)  # the replicas' group spans the dp block
    pp_link = _link(hw, dp * cp * tp * pp <= K)
    ep_link = _link(hw, ep * tp <= K and K % (ep * tp) == 0)  # ep consecutive dp ranks x tp
    ring = ring_messages(shape, b, S, cp, rec, cm.elem_bytes)
    extra = recompute_flops(shape, S, rec)
    rep = 1 / tp if sp else 1  # share of the layer norms / residuals each tp rank computes
    act_vec = 2 * (shape.mlp_matrices - 1) * F  # GELU 2F, SwiGLU 4F (forward + backward)
    vec_layer = (4 * h + 2 * h) * rep + act_vec / tp + (2 * a * S / tp if cm.attention == "math" else 0)
    if rec == "full":
        vec_layer += (2 * h + 2 * h) * rep + act_vec / 2 / tp
    stream = stream_bytes(cm.elem_bytes, z)  # the residual stream's bytes per element (fp32 over ZeRO-0's params)
    x = b * S // cp * h * stream  # bytes of one (b, S/cp, h) activation of the stream: a pipeline message

    def tp_time(layers, first, last):  # one micro-batch's tensor-parallel collectives (tp_messages)
        return sum(collective_time(calls * nbytes, op, tp, *tp_link, calls=calls)
                   for op, nbytes, calls in tp_messages(shape, b * S // cp, sp, rec, cm.elem_bytes, stream, layers,
                                                        first, last))
    stage, parts, stage_times = -1.0, {}, []
    for r in range(pp):
        layers = sum(counts[c * pp + r] for c in range(v))
        first, last = r == 0, r == pp - 1
        flops = m_flops(shape, b, S, layers, last, tp, rec) / cp  # S/cp queries, each against all S keys
        vec = b * S / cp * (layers * vec_layer + (2 * V / tp if last else 0))
        # the ring's hops overlap the attention of the block in hand: exposed = transfer - attention
        attn_s = b * S / cp * (12 + 4 * (rec != "none")) * h * S / tp / (hw.peak_flops * cm.compute_eff)
        hops = collective_time(ring["kv"] * ring["kv_bytes"] + ring["dkv"] * ring["dkv_bytes"], "p2p",
                               2 if cp > 1 else 1, *cp_link, calls=ring["kv"] + ring["dkv"])
        t = {"compute": flops / (hw.peak_flops * cm.compute_eff), "vector": vec / hw.vector_rate,
             "overhead": layers * cm.launch_s,
             "pp_comm": collective_time(2 * v * (x / tp if sp else x), "p2p", 2 if pp > 1 else 1,
                                        *pp_link, calls=2 * v),
             "tp_comm": tp_time(layers, first, last),
             "cp_comm": layers * max(0.0, hops - attn_s),
             "ep_comm": collective_time(moe["all_to_all_bytes"][r] / m if moe else 0, "all_gather", ep, *ep_link,
                                        calls=(8 if rec == "full" else 5) * layers)}
        stage_times.append(sum(t.values()))
        if stage_times[-1] > stage:
            stage, parts = stage_times[-1], t
    # fill + drain run through every other stage once (in chunks of 1/v with interleaving): for
    # equal stages this is the bubble (p-1)/(v*m + p-1) of the whole step (bubble_theory); the
    # schedule's idle per rank relative to 1F1B's, at the F : B : W split of a layer's matmul FLOPs
    # (zero-bubble schedules: pipeline_idle)
    pipe = pipeline_time(stage_times, m, kind, v, (2 * W + 4 * h * S, 2 * W + 8 * h * S + extra, 2 * W))
    big = max(range(pp), key=lambda r: params[r])  # the rank with the most parameters
    root = params[big] - rank_layers[big] * shape.block_params(tp)  # embeddings, final norm, head of that rank
    fsdp2 = layout.get("zero_impl", "native") == "fsdp2"
    calls, root_calls = _sweep_calls(shape, tp, rank_layers[big], big, pp, fsdp2)
    if ep == 1:
        t_dp = _dp_time(z, m, calls, params[big], dp * cp, dp_link, cm, n_rep, rep_link, root, fsdp2, root_calls)
    else:  # the dense gradients over dp x cp, the local experts' over the (dp x cp) / ep ranks holding them
        t_dp = (_dp_time(z, m, calls, params[big] - experts[big], dp * cp, dp_link, cm, n_rep, rep_link, root, fsdp2,
                         root_calls)
                + _dp_time(z, m, rank_layers[big], experts[big] / ep, dp * cp // ep, dp_link, cm, n_rep, rep_link))
    t_dp = exposed_dp(t_dp, m * (parts["compute"] + parts["vector"]), hw.overlap)
    host = host_bytes(off, -(-max(params) // (dp * cp // n_rep)), m)
    if host and not cm.host_link:
        raise ValueError(f"offload {off!r} needs a host link to price (CostModel.host_link, --host-link)")
    t_host = host / cm.host_link if host else 0.0
    step = pipe + t_dp + t_host
    tokens = global_batch * S
    model_flops = (6 * shape.flop_params() + 12 * L * h * S) * tokens
    breakdown = {k: m * val for k, val in parts.items()}
    breakdown.update(bubble=pipe - m * stage, dp_comm=t_dp)
    if off != "none":
        breakdown["host_comm"] = t_host
    if moe:  # what ``zerotron memory --ep`` reports for this layout (``analysis.memory.moe_estimate``)
        layout = {**layout, "moe": {"state_bytes": [x["total_bytes"] for x in moe["state_bytes"]],
                                    "expert_state_bytes": [x["expert_state_bytes"] for x in moe["state_bytes"]],
                                    "all_to_all_bytes": moe["all_to_all_bytes"]}}
    return {**layout, "microbatches": m, "virtual_stages": v, "sp": sp,
            "stage_time_s": stage_times,
            "memory_bytes_per_gpu": int(mem), "predicted_step_time_s": step,
            **({"host_bytes_per_step": host} if off != "none" else {}),
            "predicted_tokens_per_s": tokens / step,
            "predicted_mfu": model_flops / (step * dp * cp * tp * pp * hw.peak_flops),
            "time_breakdown_s": breakdown}


def _replicas(dp: int, tp: int, pp: int, cm: CostModel) -> list[int]:
    """HSDP replica counts to price for a (dp, tp, pp) mesh: 1 (flat), and, where the dp x tp
    block spans several nodes, R = dp * tp / gpus_per_node so that each shard group x tp fills one
    node (the layout HSDP is for). Under a pipeline the same rule holds per stage: pp is the
    outermost axis, so each stage's dp x tp block is contiguous (pp x native HSDP runs, one ZeRO
    driver or DDP per pipeline rank)."""
    K = cm.gpus_per_node
    if dp * tp <= K or K % tp or dp % (K // tp):
        return [1]
    r = dp // (K // tp)
    return [1, r] if r > 1 else [1]


def _expert_degrees(shape: Shape, dp: int, pp: int, cp: int, rep: int = 1) -> list[int]:
    """Expert-parallel degrees to price (the plan's rules, ``ParallelPlan._check_experts``): for a
    mixture-of-experts model every ep dividing n_experts and the batch degree dp x cp (the ep group is
    carved out of the ranks holding different tokens; under HSDP with ``rep`` replicas the shard
    degree dp / rep x cp), and under a pipeline only without HSDP; else 1."""
    if not shape.n_experts or (pp > 1 and rep > 1):
        return [1]
    batch = dp // rep * cp
    return [e for e in range(1, batch + 1) if batch % e == 0 and shape.n_experts % e == 0]


def _refused(pp: int, rep: int) -> bool:
    """True for a layout zerotron's config validation refuses among those the planner prices
    (native DDP / ZeRO-0..3): none. Pipeline x ZeRO-1/2/3 and pipeline x native HSDP run (one ZeRO
    driver, ``parallel.data.zero``, per pipeline rank), and ``_replicas`` proposes HSDP there too."""
    return False


def _rank_key(r: dict) -> tuple:
    return (r["predicted_step_time_s"], r["memory_bytes_per_gpu"], r["pp"], r["tp"], r.get("cp", 1), r.get("ep", 1),
            r["zero_stage"], SCHEDULE_ORDER.index(r["schedule"]), -r["micro_batch"],
            RECOMPUTE_ORDER.index(r["recompute"]))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending (O(sqrt n): a count of 10**9 GPUs is still quick)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _mesh_refusal(shape: Shape, dp: int, tp: int, pp: int, cp: int, global_batch: int, seq: int,
                  sp: bool) -> str | None:
    """Why the plan prices no layout of the mesh ``dp x tp x pp x cp`` -- "divisibility" (cp: the
    zigzag split needs seq divisible by 2 cp; tp: :func:`tp_refusal`, with sequence parallelism on
    seq / cp; dp must divide the global batch) or "layers" (pp > n_layer) -- or None."""
    if (seq % (2 * cp) if cp > 1 else 0) or tp_refusal(tp, shape.tp_sizes(), seq // cp if sp else None) \
            or global_batch % dp:
        return "divisibility"
    return "layers" if pp > shape.n_layer else None


def split_refusal(shape: Shape, gpus: int, global_batch: int, seq: int, cm: CostModel) -> str | None:
    """Why no mesh dp x tp x pp x cp = ``gpus`` passes :func:`_mesh_refusal` (then no layout can be
    priced at any memory size, so "add GPUs or memory" is the wrong advice: 100,000 GPUs for a
    global batch of 256 said so), or None when some mesh does. The one line names the rules and the
    GPU counts, multiples of ``cm.gpus_per_node``, nearest to ``gpus`` below and above it that some
    mesh can split (none above when ``gpus`` exceeds the largest: global batch x largest tp x
    n_layer x largest cp)."""
    if any(_mesh_refusal(shape, gpus // (t * p * c), t, p, c, global_batch, seq, cm.sp) is None
           for t in _divisors(gpus) for p in _divisors(gpus // t) for c in _divisors(gpus // (t * p))):
        return None
    tps = [t for t in range(1, shape.n_head + 1) if not tp_refusal(t, shape.tp_sizes())]
    cps = [1] + [c for c in _divisors(seq // 2) if c > 1] if seq >= 2 else [1]
    fits = {d * t * p * c for d in _divisors(global_batch) for t in tps for p in range(1, shape.n_layer + 1)
            for c in cps if _mesh_refusal(shape, d, t, p, c, global_batch, seq, cm.sp) is None}
    k = cm.gpus_per_node
    below = max((g for g in fits if g < gpus and g % k == 0), default=None)
    above = min((g for g in fits if g > gpus and g % k == 0), default=None)
    near = " or ".join(f"--gpus {g}" for g in (below, above) if g is not None)
    most = f"; at most {max(fits):,} GPUs can be used" if above is None else ""
    return (f"no split of {gpus:,} GPUs as dp x tp x pp x cp fits this model and batch: dp must divide the global "
            f"batch ({global_batch}), tp must be one of {tps}, pp at most n_layer ({shape.n_layer}), cp must divide "
            f"seq / 2 ({seq // 2}){most}; pass {near or 'fewer GPUs'}, or change --global-batch")


def plan(cfg, gpus: int, gpu_mem: int, global_batch: int, seq: int, cm: CostModel,
         supported_only: bool = False) -> dict:
    """Enumerate and rank layouts of the model of ``cfg`` (GPT-2/Llama config or :class:`Shape`) on
    ``gpus`` GPUs with ``gpu_mem`` bytes each.

    Layouts: dp*cp*tp*pp = gpus (cp: context parallel with ring attention, seq divisible by 2 cp)
    with tp accepted by :func:`zerotron.models.layout.tp_refusal` (the rule
    the plan applies: tp | n_head, n_kv_head and the SwiGLU width, and tp | seq with SP), pp <= n_layer,
    dp | global_batch; micro-batch a power of two dividing global_batch/dp; for pp > 1 schedule 1f1b | gpipe |
    interleaved (v = 2, only when m % pp == 0 and 2pp <= n_layer) | zb-h1 | zb-v (v = 2, only when
    2pp <= n_layer, and only with ``cm.backend`` = "gloo": the runner refuses it on NCCL), "none"
    for pp = 1; ZeRO 0-3 (with ``cm.host_link``, a layout over ``gpu_mem`` is priced again with
    ``offload`` "optimizer", then at ZeRO-3 "params", and kept if that fits); for a mixture-of-experts
    model every ep dividing n_experts and dp x cp (the shard degree dp/R x cp under HSDP; no HSDP
    with ep under a pipeline: :func:`_expert_degrees`);
    recompute none | selective | full. Each is priced by :func:`evaluate`; those over ``gpu_mem``
    are dropped, and with ``supported_only`` what zerotron's config validation refuses
    (:func:`_refused`; since pipeline x ZeRO-2/3 runs, nothing the planner proposes). Returns ``{"layouts": feasible ones, best (shortest step) first, ties broken by
    memory then (pp, tp, zero, schedule, -micro_batch, recompute), "dropped": {reason: count}}``:
    "divisibility" and "layers" count (dp, tp, pp) meshes, the others layouts ("backend": zb-v
    on NCCL). Raises ValueError
    for non-positive sizes, gpus % gpus_per_node != 0, seq > block_size, or when no mesh of ``gpus``
    passes the divisibility and layer rules (:func:`split_refusal`: the line names the GPU counts
    that can be split)."""
    for name, val in (("gpus", gpus), ("gpus_per_node", cm.gpus_per_node),
                      ("global_batch", global_batch), ("seq", seq)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if gpus % cm.gpus_per_node:
        raise ValueError(f"gpus ({gpus}) must be a multiple of gpus_per_node ({cm.gpus_per_node})")
    if seq > cfg.block_size:
        raise ValueError(f"seq ({seq}) exceeds the model's block_size ({cfg.block_size})")
    if cm.backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be nccl or gloo, got {cm.backend!r}")
    dropped = dict.fromkeys(("divisibility", "layers", "schedule", "backend", "unsupported", "memory"), 0)
    out = []
    meshes = [(gpus // (t * p * c), t, p, c) for t in _divisors(gpus) for p in _divisors(gpus // t)
              for c in _divisors(gpus // (t * p))]
    cfg = cfg if isinstance(cfg, Shape) else shape_of(cfg)
    refusal = split_refusal(cfg, gpus, global_batch, seq, cm)
    if refusal:
        raise ValueError(refusal)
    for dp, tp, pp, cp in meshes:
        why = _mesh_refusal(cfg, dp, tp, pp, cp, global_batch, seq, cm.sp)
        if why:
            dropped[why] += 1
            continue
        per_dp = global_batch // dp
        for b in [1 << i for i in range(per_dp.bit_length()) if per_dp % (1 << i) == 0]:
            m = per_dp // b
            for kind in ["none"] if pp == 1 else PIPELINE_KINDS:
                if (kind == "interleaved" and m % pp) or (kind in ("interleaved", "zb-v") and 2 * pp > cfg.n_layer):
                    dropped["schedule"] += 12  # 4 ZeRO stages x 3 recompute modes
                    continue
                if kind in NCCL_REFUSED and cm.backend == "nccl":
                    dropped["backend"] += 12
                    continue
                for z, rec, rep, ep in [(z, rec, rep, ep) for z, rec, rep in product(
                        range(4), RECOMPUTE_ORDER, _replicas(dp, tp, pp, cm) if cp == 1 else [1])
                        for ep in _expert_degrees(cfg, dp, pp, cp, rep)]:
                    if supported_only and _refused(pp, rep):
                        dropped["unsupported"] += 1
                        continue
                    lay = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": z, "schedule": kind,
                           "micro_batch": b, "recompute": rec}
                    if rep > 1:
                        lay["dp_replicate"] = rep
                    if ep > 1:
                        lay["ep"] = ep
                    if cp > 1:
                        lay["cp"] = cp
                    res = evaluate(cfg, lay, seq, global_batch, cm, gpu_mem)
                    # with a host link: offload where the layout does not fit otherwise (optimizer, then params)
                    for off in (("optimizer", "params") if z == 3 else ("optimizer",)) if z and cm.host_link else ():
                        if res["memory_bytes_per_gpu"] <= gpu_mem:
                            break
                        res = evaluate(cfg, {**lay, "offload": off}, seq, global_batch, cm, gpu_mem)
                    if res["memory_bytes_per_gpu"] > gpu_mem:
                        dropped["memory"] += 1
                    else:
                        out.append(res)
    return {"layouts": sorted(out, key=_rank_key), "dropped": dropped}




def comm_bytes(shape: Shape, layout: dict, seq: int, global_batch: int, pp_rank: int = 0, elem_bytes: int = 2,
               sp: bool = False, bucket_bytes: int = 25 << 20, reduce_bytes: int | None = None,
               layer_counts: list[int] | None = None, with_calls: bool = False):
    """Bytes per process group of one step of pipeline rank ``pp_rank`` of ``layout`` (keys dp, tp,
    pp, zero_stage, micro_batch, schedule, recompute, dp_replicate; optional cp, zero_impl) as the
    code sends them (tests/test_dryrun_planbytes.py; :func:`evaluate` times the same tp, pp and dp
    messages: :func:`tp_messages`, :func:`dp_messages`), in the nccl-tests size convention of ``comm.STATS`` (all-gather: output bytes,
    reduce-scatter: input bytes), ``elem_bytes`` per element (2: bf16; 4: fp32 training) and
    ``reduce_bytes`` per element of the gradient reductions (``parallel.reduce_dtype``: 4 for fp32,
    zerotron's default under bf16; None: ``elem_bytes``):

    * "tp": per micro-batch the messages of :func:`tp_messages` (per layer the row-parallel
      outputs in ``elem_bytes``, each column-parallel Linear's input gradient in the residual
      stream's dtype -- fp32 over ZeRO-0's fp32 parameters under bf16, :func:`stream_bytes` --, the
      embedding on the first stage, the head's input gradient and the loss on the last);
    * "pp": per micro-batch and chunk one activation and one gradient of b*S*h (/tp with SP) in
      the residual stream's dtype (:func:`stream_bytes`), i.e.
      2*v*m*x -- what a first or last stage moves; a middle stage receives and sends both ways,
      twice that;
    * "dp" (the rank's P parameters, :func:`dp_messages`; gradient reductions move G = reduce_bytes x P, parameter
      all-gathers elem_bytes x P): ZeRO-0 one all-reduce of G; ZeRO-1 a reduce-scatter of G + an
      all-gather of the parameters; ZeRO-2 m reduce-scatters + one all-gather; ZeRO-3 m
      reduce-scatters and 2m all-gathers of the blocks, the root unit (embeddings, final norm,
      head) gathered once per step (``parallel.data.zero`` keeps it for the step; FSDP2,
      ``layout["zero_impl"]`` "fsdp2", re-gathers it like a block: 2m). ZeRO pads each flat
      buffer (one per unit and weight-decay group) to a multiple of dp, FSDP2 each parameter's
      dim 0: the traced bytes exceed these by less than dp elements per buffer and collective. HSDP (dp_replicate R > 1): these over the shard group
      "dp_shard" (ZeRO-0: reduce-scatter + all-gather of G), plus an all-reduce of G/S over the
      replicas "dp_rep". Under context parallelism (``layout["cp"]`` > 1) each rank's activations
      are b*S/cp*h, the dp figures are over the dp x cp group "batch", and "cp" holds the ring
      attention's messages (:func:`ring_messages`) sent and received.

    ``layer_counts``: layers per model stage as the pipeline runner split them (``pp_split``;
    None: :func:`~zerotron.analysis.activations.stage_layer_counts`' even split).
    Groups of size 1 are left out; bookkeeping all-reduces (token counts, grad norm, metrics) and
    the tied-embedding all-reduce of a pipeline are not priced. Returns ``{group: bytes}``; with
    ``with_calls`` also ``{group: calls}`` of the ZeRO / FSDP2 collectives (:func:`dp_messages`;
    ZeRO-0's buckets, which break at parameter boundaries, are not counted)."""
    dp, tp, pp, b, z = (layout[k] for k in ("dp", "tp", "pp", "micro_batch", "zero_stage"))
    rep, kind, rec = layout.get("dp_replicate", 1), layout["schedule"], layout["recompute"]
    cp = layout.get("cp", 1)
    sp = sp and tp > 1
    v = 2 if kind in ("interleaved", "zb-v") else 1
    m = global_batch // (dp * b)
    counts = looped_counts(list(layer_counts) if layer_counts else stage_layer_counts(shape.n_layer, pp * v), pp, kind)
    params = stage_num_params(shape, tp, pp, v, counts)[pp_rank]
    layers = sum(counts[c * pp + pp_rank] for c in range(v))
    x = b * seq // cp * shape.n_embd * elem_bytes
    out = {}
    if tp > 1:
        msgs = tp_messages(shape, b * seq // cp, sp, rec, elem_bytes, stream_bytes(elem_bytes, z), layers,
                           pp_rank == 0, pp_rank == pp - 1)
        out["tp"] = m * sum(nbytes * calls for _, nbytes, calls in msgs)
    if pp > 1:  # a stage's output and its gradient: the residual stream (fp32 over ZeRO-0's fp32 parameters)
        out["pp"] = 2 * v * m * (x // tp if sp else x) * stream_bytes(elem_bytes, z) // elem_bytes
    if cp > 1:  # ring attention: every message counted at its sender and its receiver (send + recv)
        r = ring_messages(shape, b, seq, cp, rec, elem_bytes)
        out["cp"] = 2 * m * layers * (r["kv"] * r["kv_bytes"] + r["dkv"] * r["dkv_bytes"])
    red = reduce_bytes or elem_bytes
    grad, root = red * params, params - layers * shape.block_params(tp)
    fsdp2 = layout.get("zero_impl", "native") == "fsdp2"
    calls, root_calls = _sweep_calls(shape, tp, layers, pp_rank, pp, fsdp2)
    msgs = dp_messages(z, m, calls, params, root, elem_bytes, red, fsdp2, root_calls)
    per_dp, n_dp = sum(nbytes for _, nbytes, _, _ in msgs), sum(n for _, _, n, _ in msgs)
    n_calls = {}
    if rep > 1:
        s = dp // rep
        out["dp_shard"] = 2 * grad if z == 0 else per_dp
        out["dp_rep"] = -(-grad // s)
        if z:
            n_calls = {"dp_shard": n_dp}
    elif dp * cp > 1:  # gradients are reduced over dp x cp (the "batch" group) under cp
        out["batch" if cp > 1 else "dp"] = per_dp
        if z:
            n_calls = {"batch" if cp > 1 else "dp": n_dp}
    return (out, n_calls) if with_calls else out
