"""The collectives one training step sends, per process group, as the code sends them: the
tensor-parallel messages of a micro-batch (:func:`tp_messages`), the ring attention's point-to-point
hops (:func:`ring_messages`), the data-parallel reductions and gathers (:func:`dp_messages`, with
native ZeRO's calls per flat buffer: :func:`dp_flat_calls`) and their sum per group for one pipeline
rank (:func:`comm_bytes`). Pure arithmetic, in the nccl-tests size convention of ``comm.STATS``;
the one rule for the bytes the dry run checks (tests/test_dryrun_planbytes.py) and the seconds the
planner prices (:mod:`zerotron.analysis.cost_model`, :func:`zerotron.analysis.layout_cost.evaluate`)."""
from __future__ import annotations

from zerotron.analysis.activations import looped_counts, stage_layer_counts
from zerotron.analysis.flops import Shape
from zerotron.analysis.memory import stage_num_params
from zerotron.plan import CHUNKED_SCHEDULES


def dp_flat_calls(shape: Shape, tp: int, blocks: int, first: bool, last: bool, pipeline: bool) -> tuple[int, int]:
    """Collectives of one sweep over a rank's native ZeRO units (``(all units', root units')``): the
    code sends one per flat buffer, and ``parallel.data.flat_units.build_flats`` makes one flat per
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
    one rule for :func:`comm_bytes` (bytes) and :func:`~zerotron.analysis.layout_cost.evaluate` (seconds)."""
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


def sweep_calls(shape: Shape, tp: int, layers: int, pp_rank: int, pp: int, fsdp2: bool) -> tuple[int, int]:
    """(collectives per sweep over pipeline rank ``pp_rank``'s units, the root units' share):
    native ZeRO's flats (:func:`dp_flat_calls`), FSDP2 one per unit (each block, the root)."""
    first, last = pp_rank == 0, pp_rank == pp - 1
    if fsdp2:
        return layers + (first or last), int(first or last)
    return dp_flat_calls(shape, tp, layers, first, last, pp > 1)


def comm_bytes(shape: Shape, layout: dict, seq: int, global_batch: int, pp_rank: int = 0, elem_bytes: int = 2,
               sp: bool = False, bucket_bytes: int = 25 << 20, reduce_bytes: int | None = None,
               layer_counts: list[int] | None = None, with_calls: bool = False):
    """Bytes per process group of one step of pipeline rank ``pp_rank`` of ``layout`` (keys dp, tp,
    pp, zero_stage, micro_batch, schedule, recompute, dp_replicate; optional cp, zero_impl) as the
    code sends them (tests/test_dryrun_planbytes.py; :func:`~zerotron.analysis.layout_cost.evaluate` times the same tp, pp and dp
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
    v = 2 if kind in CHUNKED_SCHEDULES else 1
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
    calls, root_calls = sweep_calls(shape, tp, layers, pp_rank, pp, fsdp2)
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
