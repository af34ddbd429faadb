"""What the estimators compute for a traced rank of a dry run (``analysis.dryrun``): model states
(``memory.model_state_bytes``) + activations (``activations.activation_bytes``) + the terms the code
allocates beside them at the step's peak, each derived from the code and measured (:func:`estimate`)."""
from __future__ import annotations

from dataclasses import dataclass

from zerotron.analysis.activations import LOSS_BYTES, activation_bytes, looped_counts, stage_layer_counts
from zerotron.analysis.dryrun_rank import model_config
from zerotron.analysis.flops import shape_of
from zerotron.analysis.memory import model_state_bytes, stage_num_params
from zerotron.config_sections import Config

MEM_DTYPE = {"fp32": "fp32", "bf16": "bf16-mixed", "fp64": "fp64"}
ACT_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp64": "fp32"}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    dp_replicate: int
    zero_stage: int
    schedule: str
    microbatches: int
    virtual_stages: int
    micro_batch: int
    seq: int
    recompute: str
    sp: bool
    dtype: str


def layout_of(cfg: Config, plan, mcfg) -> Layout:
    p = cfg.parallel
    dims = plan.dims
    schedule = p.pp_schedule if dims.pp > 1 else "1f1b"
    v = p.virtual_stages if schedule in ("interleaved", "zb-v") else 1
    n_micro = cfg.train.global_batch // (dims.size("dp") * cfg.train.micro_batch)
    return Layout(dims.size("dp"), dims.tp, dims.pp, p.dp_replicate, p.zero_stage, schedule,
                   p.microbatches or n_micro, v, cfg.train.micro_batch, mcfg.block_size,
                   cfg.train.activation_checkpointing, bool(p.sequence_parallel) and dims.tp > 1, cfg.train.dtype)


def estimate(cfg: Config, plan, pp_rank: int, layer_counts: list[int] | None = None, tp_rank: int = 0) -> dict:
    """What the estimators compute for pipeline rank ``pp_rank`` (tensor-parallel rank ``tp_rank``)
    of ``cfg``'s layout, at the moment of its peak: ``{"model_states": {params_bytes, grads_bytes, optimizer_bytes,
    total_bytes} (:func:`~zerotron.analysis.memory.model_state_bytes`), "activations" (saved, of
    the schedule's micro-batches in flight: :func:`~zerotron.analysis.activations.activation_bytes`,
    autocast's dtypes in bf16), "terms": {...}, "total"}``; ``terms`` are what the code allocates
    beside them at the peak (the last stage's is the loss's backward, the others' a backward with
    every in-flight micro-batch held), each derived from the code and measured:

    * ``zero1_fp32_grad``: native ZeRO-1 in bf16 keeps an fp32 shard gradient (4 bytes per shard
      element) beside the bf16 full gradient (the paper's 2 + 2 + 12 omits it);
    * ``weight_casts``: autocast over fp32 parameters (bf16 with DDP or tp/pp without ZeRO) casts
      every matmul weight to bf16 in each forward and the Linears keep the copies until their
      backward: 2 bytes per local matmul parameter and micro-batch in flight (full recomputation:
      only the head's, the blocks' are dropped with their saved tensors);
    * ``stage_outputs``: a pipeline stage keeps each in-flight micro-batch's output (b, s, h) in the
      stream's dtype until its backward, and receives one gradient of that size;
    * ``stage_inputs``: a stage after the first keeps each in-flight micro-batch's received input
      (the executor's saved (input, output) pair) until its backward, and one input gradient
      it sent until its next comm run (1F1B's last stage: the micro-batch in backward and the
      previous one's gradient, 2 (b, s, h));
    * ``loss_backward``: :func:`~zerotron.analysis.activations.loss_backward_bytes` (last stage);
    * ``gathered``: native ZeRO-3 holds the last stage's root unit (embedding, final norm, head)
      gathered in the compute dtype during the loss's backward; FSDP2 does not: it reshards the
      root after the forward too (zerotron passes ``reshard_after_forward`` explicitly, which
      turns off torch's keep-the-root-gathered default) and gathers it again at the root's
      backward, after the loss's (MemTracker sees the gathers: FSDP2 resizes their storages
      through ``UntypedStorage.resize_``, which the tracker follows);
    * ``fsdp2_no_grads``: FSDP2 frees its gradients between steps (set to None), so none exist at
      the loss's backward (negative); they are shards of its sharded parameters, in the parameter
      dtype (fp32 under bf16 autocast: 4 bytes per shard element where the bf16-mixed states
      count 2; FSDP2's fp32 parameter shard and Adam's two moments make up the same 16 bytes);
    * ``finish_grads_moment`` (native ZeRO-1): after the backward, ``finish_grads`` reduce-scatters
      unit by unit, at most ``ZeroSync.reduce_window`` (2) units in flight, each holding its
      gradient cast to ``reduce_dtype`` (when it differs from the gradient's) and its output
      shard; the largest neighbouring units are the root unit (embedding / head) and blocks.
      When that moment (model states + those buffers) exceeds the backward's, the difference
      (0 otherwise; a pipeline's first stage under full recomputation, where little is held);
    * ``block_backward`` (a stage without the head, whose peak is a block's backward): what that
      backward holds beyond the block's saved tensors at its worst moment
      (:func:`~zerotron.analysis.activations.block_backward_bytes`: the SwiGLU backward, or
      RMSNorm's composite fp32 backward);
    * ``fsdp2_last_block_moment`` (FSDP2, one micro-batch, no pipeline): when the backward of the
      last block it reaches (:func:`fsdp2_last_block_bytes`: the gradient shards of the blocks
      done, the reduce-scatter and all-gather buffers, the gathered root and the head's unsharded
      gradient) exceeds the loss's moment, the difference (0 otherwise; full recomputation at
      Llama-3-70B's size, where the activations are small beside 4 bytes per shard element);
    * with recomputation, on the last stage: the loss's backward (the peak) comes before any layer
      is recomputed, so the recompute workspace is not live then (``recompute_workspace_not_live``,
      negative); ``recompute_moment`` adds the difference when the first recomputation's backward
      (workspace and ``block_backward`` live, the loss's tensors freed, and the head's and the final
      norm's where ``block_backward`` is modelled) is the larger moment;
    * ``zero3_block_moment`` (native ZeRO-3, plain runner, full recomputation): when the backward of
      a block with the reduce window full (:func:`zero3_block_bytes`) exceeds the loss's moment,
      the difference.

    fp64 training: activations counted at fp32's 4 bytes (the estimator has no 8-byte activations).
    ``layer_counts``: layers per model stage as the pipeline runner split them (its ``split``),
    None = the estimators' even split. Attention "flash" (CPU SDPA without dropout)."""
    from zerotron.analysis.activations import block_backward_bytes, loss_backward_bytes

    mcfg = model_config(cfg)
    lay = layout_of(cfg, plan, mcfg)
    shape = shape_of(mcfg)
    split = list(layer_counts) if layer_counts else stage_layer_counts(shape.n_layer, lay.pp * lay.virtual_stages)
    counts = looped_counts(split, lay.pp, lay.schedule)
    params = stage_num_params(shape, lay.tp, lay.pp, lay.virtual_stages, counts)[pp_rank]
    cp = plan.dims.cp  # context parallel: states sharded over dp x cp, each rank seq / cp tokens
    states = model_state_bytes(params, lay.dp * cp, lay.zero_stage, MEM_DTYPE[lay.dtype], "adam", lay.dp_replicate)
    bf16 = lay.dtype == "bf16"
    bf16_params = bf16 and lay.zero_stage >= 1  # ZeRO's compute copies, FSDP2's param dtype
    seq = lay.seq // cp
    act = activation_bytes(shape, lay.micro_batch, seq, tp=lay.tp, sp=lay.sp, pp=lay.pp, schedule=lay.schedule,
                           microbatches=lay.microbatches, virtual_stages=lay.virtual_stages,
                           recompute=lay.recompute, dtype=ACT_DTYPE[lay.dtype], attention="flash",
                           dropout=cfg.model.dropout > 0, layer_counts=layer_counts, autocast=bf16,
                           bf16_params=bf16_params)
    a = act["per_rank_bytes"][pp_rank]
    last = pp_rank == plan.placement.last_rank if lay.pp > 1 else True
    layers = sum(counts[c * lay.pp + pp_rank] for c in range(lay.virtual_stages))
    flight = act["peak_in_flight"][pp_rank] if lay.pp > 1 else 1
    fsdp2 = cfg.parallel.zero_impl == "fsdp2" and lay.zero_stage >= 2
    V, h, t = shape.vocab_size, shape.n_embd, lay.tp
    head = -(-V // t) * h if last else 0  # the output head's local matmul weight
    e = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    r = 4 if bf16 and not bf16_params else e  # residual stream bytes
    sbh = seq * lay.micro_batch * h // (t if lay.sp else 1)
    terms = {"zero1_fp32_grad": 4 * -(-params // (lay.dp * cp // lay.dp_replicate))
             if bf16 and lay.zero_stage == 1 and not fsdp2 else 0,
             "weight_casts": 0, "stage_outputs": 0, "stage_inputs": 0, "loss_backward": 0, "gathered": 0,
             "fsdp2_no_grads": -(2 if bf16 else 1) * states["grads_bytes"] if fsdp2 and last else 0}
    if bf16 and not bf16_params:
        blocks = layers * shape.block_matmul_params() // t
        terms["weight_casts"] = 2 * (head + (blocks * flight if lay.recompute != "full" else 0))
    if lay.pp > 1 and not last:
        terms["stage_outputs"] = (flight + 1) * r * sbh
    if lay.pp > 1 and (pp_rank > 0 or lay.virtual_stages > 1):
        terms["stage_inputs"] = (flight + 1) * r * sbh
    if last:
        terms["loss_backward"] = loss_backward_bytes(seq, lay.micro_batch, V, t, bf16, e, tp_rank)
        if lay.zero_stage == 3 and not fsdp2:
            root = params - layers * shape.block_params(t)
            terms["gathered"] = (2 if bf16 else e) * root
    bwd = block_backward_bytes(shape, seq, lay.micro_batch, t, lay.sp, ACT_DTYPE[lay.dtype], bf16, bf16_params)
    if not last:  # the peak is a block's backward
        terms["block_backward"] = bwd
    if last and lay.recompute != "none":  # the loss's backward comes before any layer is recomputed:
        loss_moment = terms["loss_backward"] + terms["gathered"] - act["recompute_workspace_bytes"]
        # freed by then: the loss's saved tensors and, once the head's backward is done, the head's and the
        # final norm's (all of the last stage's output_bytes). Counted where the block's backward is
        # modelled (bwd > 0: bf16 compute parameters); over fp32 parameters the moment also holds the
        # recomputed block's weight casts and fp32 backward temporaries, which are not (test tp2-full-casts
        # 1.009 with the loss's alone, 1.036 with all of output_bytes), so there only the loss's are taken.
        loss_saved = LOSS_BYTES * seq * lay.micro_batch * -(-V // t)
        freed = act["output_bytes"] if bwd else loss_saved
        terms["recompute_moment"] = max(0, bwd - freed - loss_moment)  # (the later moment, if larger)
        terms["recompute_workspace_not_live"] = -act["recompute_workspace_bytes"]
    if fsdp2 and lay.pp == 1 and lay.microbatches == 1:  # the step's other moment: the last block's backward
        later = fsdp2_last_block_bytes(cfg, lay, shape, states, act, params, layers, cp)
        terms["fsdp2_last_block_moment"] = max(0, later - states["total_bytes"] - a - sum(terms.values()))
    if lay.zero_stage == 3 and not fsdp2 and lay.pp == 1 and lay.recompute == "full" and layers >= 3:
        later = zero3_block_bytes(cfg, lay, shape, states, act, params, layers, cp)  # a mid-backward block's moment
        terms["zero3_block_moment"] = max(0, later - states["total_bytes"] - a - sum(terms.values()))
    total = states["total_bytes"] + a + sum(terms.values())
    if lay.zero_stage == 1 and not fsdp2:  # the step's other moment: finish_grads' reduce-scatters
        from zerotron.parallel.data.zero import ZeroSync
        from zerotron.parallel.precision import reduce_dtype

        red = reduce_dtype(lay.dtype, cfg.parallel.reduce_dtype).itemsize
        n, block = ZeroSync.reduce_window, shape.block_params(t)
        units = max(params - layers * block + (n - 1) * block, n * block) if layers else params  # largest neighbours
        shards = lay.dp * cp // lay.dp_replicate
        window = (red if red != (2 if bf16 else e) else 0) * units + red * -(-units // shards)
        finish = states["total_bytes"] + terms["zero1_fp32_grad"] + window
        terms["finish_grads_moment"] = max(0, finish - total)
        total += terms["finish_grads_moment"]
    return {"params": params, "dp": lay.dp, "model_states": states, "activations": a, "terms": terms,
            "total": total}


def zero3_block_bytes(cfg: Config, lay: Layout, shape, states: dict, act: dict, params: int, layers: int,
                      cp: int) -> int:
    """Bytes native ZeRO-3 (plain runner, full recomputation) holds in the backward of block L - 3,
    the first whose backward runs with ``ZeroSync.reduce_window`` (2) units' reduce-scatters in
    flight, on one rank: the step's peak when the activations are small beside a block's
    parameters (Llama-3-70B dp 8: 1.031 x the loss's moment before this was counted). Derived from
    ``parallel.data.zero`` / ``flat_shard`` and measured with a dry run's MemTracker (live storages
    at the peak by size and category; ``tests/test_dryrun_peak.py``, ``zero3-dp4-full-grads``):

    * the model states (their 16 bytes per shard element: the fp32 shard gradients included);
    * the root unit gathered for the step in the compute dtype (ce R) and the gradients of the
      head and final norm, made by the loss's backward and held in the compute dtype until the
      root unit's reduction at the backward's end (ce (V/t h + norm));
    * two blocks gathered in the compute dtype: the one in backward and the one its pre-backward
      hook prefetches (2 ce B, B a block's parameters on this tp rank), and the prefetch's
      all-gather input, the master shard cast to the compute dtype, held by the in-flight work
      (ce ceil(B/N));
    * the reduce window: the fp32 (``reduce_dtype``) inputs of the two blocks whose
      reduce-scatters are in flight, each a copy of the block's full gradient, and their output
      shards (2 red (B + ceil(B/N)));
    * the checkpointed inputs of blocks 0 .. L - 3, the recompute workspace and the block's
      backward with its weight gradients in the compute dtype
      (:func:`~zerotron.analysis.activations.block_backward_bytes` with ``grad_bytes`` = ce).

    Further down the backward only the checkpointed inputs shrink, so this is the largest such
    moment. Several micro-batches per step repeat it per micro-batch (nothing more is held)."""
    from zerotron.analysis.activations import block_backward_bytes
    from zerotron.parallel.data.zero import ZeroSync
    from zerotron.parallel.precision import reduce_dtype

    bf16 = lay.dtype == "bf16"
    e = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    ce = 2 if bf16 else e
    red = reduce_dtype(lay.dtype, cfg.parallel.reduce_dtype).itemsize
    block = shape.block_params(lay.tp)
    root, head = params - layers * block, -(-shape.vocab_size // lay.tp) * shape.n_embd
    head_grads = (0 if shape.tied else head) + shape.norm_params  # the tied head's gradient is the embedding's
    seq, shards = lay.seq // cp, lay.dp * cp // lay.dp_replicate
    n = ZeroSync.reduce_window
    bwd = block_backward_bytes(shape, seq, lay.micro_batch, lay.tp, lay.sp, ACT_DTYPE[lay.dtype], bf16, bf16,
                               grad_bytes=ce)
    acts = (layers - n) * act["per_layer_bytes"] + act["recompute_workspace_bytes"] + bwd
    shard = -(-block // shards)
    return (states["total_bytes"] + ce * root + ce * head_grads + 2 * ce * block + ce * shard + n * red * (block + shard)
            + acts)


def fsdp2_last_block_bytes(cfg: Config, lay: Layout, shape, states: dict, act: dict, params: int, layers: int,
                            cp: int) -> int:
    """Bytes FSDP2 (one micro-batch per step, no pipeline) holds in the backward of the last block it
    reaches (block 0), on one rank: the step's peak when the activations are small (full
    recomputation at Llama-3-70B's size: 1.216 x the loss's moment before this was counted).
    Derived from torch 2.13's ``fully_shard`` (``_fsdp_collectives``: the all-gather output and the
    reduce-scatter input are kept until the next all-gather / post-backward waits on them) and
    measured with a dry run's MemTracker (``tests/test_dryrun_peak.py``, ``fsdp2-dp4-full-grads``):

    * the model states without gradients (the bf16-mixed 16 bytes per shard element less FSDP2's
      4-byte gradient shard: its fp32 parameter shard and Adam's two moments);
    * the fp32 gradient shards of the blocks already reduced, L - 2 of them (4 B/N bytes each, B a
      block's parameters on this tp rank, N the shard group);
    * block 1's reduce-scatter input in ``reduce_dtype`` (red B), held until the next post-backward;
    * block 0's all-gather output and its unsharded parameters, both in the compute dtype (2 ce B);
    * the root (embedding, final norm, head), gathered at the backward's start and resharded in its
      post-backward at the end (ce R), and the head's unsharded weight gradient (ce V/t h);
    * one layer's saved activations (its checkpointed input under full recomputation), the
      recompute workspace and the block's backward with its unsharded weight gradients
      (:func:`~zerotron.analysis.activations.block_backward_bytes` with ``grad_bytes`` = ce).

    Several micro-batches per step (FSDP2's ``no_sync`` keeps every block's unsharded gradient
    until the last) are not modelled."""
    from zerotron.analysis.activations import block_backward_bytes
    from zerotron.parallel.precision import reduce_dtype

    bf16 = lay.dtype == "bf16"
    e = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    ce, pb = (2, 4) if bf16 else (e, e)  # compute dtype; sharded parameters and gradients
    red = reduce_dtype(lay.dtype, cfg.parallel.reduce_dtype).itemsize
    block = shape.block_params(lay.tp)
    root, head = params - layers * block, -(-shape.vocab_size // lay.tp) * shape.n_embd
    seq, shards = lay.seq // cp, lay.dp * cp // lay.dp_replicate  # a rank's tokens; the shard group (dp x cp)
    no_grads = states["total_bytes"] - (2 if bf16 else 1) * states["grads_bytes"]
    bwd = block_backward_bytes(shape, seq, lay.micro_batch, lay.tp, lay.sp, ACT_DTYPE[lay.dtype], bf16, bf16,
                               grad_bytes=ce)
    acts = act["per_layer_bytes"] + act["recompute_workspace_bytes"] + bwd
    return (no_grads + pb * max(0, layers - 2) * -(-block // shards) + (red + 2 * ce) * block + ce * (root + head)
            + acts)
