"""Tensor/sequence parallelism for any ``zerotron.models.base.CausalLM``: an in-place transform
driven by the model's layout description (``model.layout()``), plus helpers.

``apply_tensor_parallel(model, tp_group, sequence_parallel, seed)`` takes a fully initialised dense
model (identical on every tp rank) and keeps this rank's slices (Shoeybi et al. 2019, "Megatron-LM",
sec. 3): each Linear the layout's ``block_tp`` names becomes column- or row-parallel (attention by
whole heads), the token embedding vocab-parallel and the output head a column-parallel projection
over the same padded vocabulary shard, so the model returns vocab-sharded logits (B, T, V_pad/tp).
Norms, position embeddings and unlisted layers are replicated. With ``sequence_parallel`` (Korthikanti et al. 2022, sec. 4.2.2) the replicated
regions (LayerNorm, dropout, residual) hold a (B, T/tp, C) sequence shard.

Collectives per training step (tp > 1; comm tags in brackets; L = n_layer):
  without SP, all-reduces: blocks 2L forward + 2L backward ["tp_block", "tp_block_bwd"];
    embedding 1 forward (g) ["tp_embed"]; LM head 1 backward (f) ["tp_head_bwd"]; loss 2 forward
    ["tp_loss"]; nothing in sync_replicated_grads.
  with SP: blocks 2L all-gathers + 2L reduce-scatters forward and the same backward; embedding
    1 reduce-scatter forward + 1 all-gather backward; LM head 1 all-gather forward + 1
    reduce-scatter backward; loss 2 all-reduces; sync_replicated_grads 1 all-reduce ["tp_grad"].

RNG (after Megatron's CUDA RNG tracker): dropout in tensor-sharded regions (attention probabilities;
with SP also every sequence-sharded dropout) draws from the tracker state "model-parallel"; dropout
in replicated regions draws from "replicated", the same stream on every tp rank of a (dp, pp)
coordinate (seeds: :func:`tp_rng_seeds`; every dp replica and pipeline stage has its own masks).
Neither uses the default generator's stream, so extra draws elsewhere cannot make replicated masks
differ across tp ranks. Checkpoints save :func:`tracker_checkpoint_state` per rank and restore it
with :func:`restore_tracker` (re-seeded, with a message, when the layout changed).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotron.distributed import comm
from zerotron.models.base import CausalLM, ParallelHooks
from zerotron.models.layout import add_token_sum, get_module, set_module
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.tensor.adapters import shard_adapter
from zerotron.parallel.tensor.layers import (
    MODEL_PARALLEL,
    REPLICATED,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_tensor,
    gather_from_tp,
    is_tp_sharded,
    shard_tensor,
    vocab_parallel_cross_entropy,
)

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


class RNGStatesTracker:
    """Named generator states swapped in and out of the default generator of ``device`` (the idea of
    Megatron-LM's CUDA RNG states tracker, Shoeybi et al. 2019, code: tensor_parallel/random.py).

    ``add(name, seed)`` creates a state (ValueError if the name exists); ``with fork(name):`` runs
    the block on that state and saves its advance, leaving the default generator exactly as it was
    (KeyError for an unknown name). ``get_states()``/``set_states()`` copy them for checkpoints.
    ``seed`` and ``coords`` ({"tp", "tp_rank", "dp_rank", "pp_rank"}) record what
    :func:`apply_tensor_parallel` seeded it from (for :func:`restore_tracker`)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        self.seed, self.coords = 0, {"tp": 1, "tp_rank": 0, "dp_rank": 0, "pp_rank": 0}

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state):
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.states[name] = torch.Generator(device=self.device).manual_seed(int(seed)).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL):
        if name not in self.states:
            raise KeyError(f"unknown RNG state {name!r}; known: {sorted(self.states)}")
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outer)

    def get_states(self) -> dict:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_DP_SHIFT, _PP_SHIFT = 32, 48  # seed offsets of the dp and pp coordinates (tp_rank stays < 2**32 - 2718)


def tp_rng_seeds(seed: int, tp_rank: int, dp_rank: int = 0, pp_rank: int = 0) -> dict:
    """Seeds of the tracker states of one (pp, dp, tp) coordinate: ``{"replicated": base,
    "model-parallel": base + 2718 + tp_rank}`` with ``base = seed + (dp_rank << 32) + (pp_rank << 48)``
    (2718: Megatron's model-parallel offset). The replicated seed ignores tp_rank (equal masks on
    every tp rank); dp replicas and pipeline stages get distinct streams; (dp, pp) = (0, 0) keeps
    the seeds of a plain tp run. Raises ValueError for ranks outside 0 <= tp < 2**31,
    0 <= dp < 2**16, 0 <= pp < 2**15 (the seeds would collide or overflow torch's 64-bit seed)."""
    if not (0 <= tp_rank < 2**31 and 0 <= dp_rank < 2**16 and 0 <= pp_rank < 2**15):
        raise ValueError(f"tp_rng_seeds: ranks out of range (tp {tp_rank}, dp {dp_rank}, pp {pp_rank})")
    base = int(seed) + (dp_rank << _DP_SHIFT) + (pp_rank << _PP_SHIFT)
    return {REPLICATED: base, MODEL_PARALLEL: base + 2718 + tp_rank}


def seed_tracker(tracker: RNGStatesTracker, seed: int) -> None:
    """(Re-)create ``tracker``'s "replicated" and "model-parallel" states from ``seed`` and the
    coordinate in ``tracker.coords`` ({"tp", "tp_rank", "dp_rank", "pp_rank"}; see tp_rng_seeds)."""
    c = tracker.coords
    tracker.states = {}
    for name, s in tp_rng_seeds(seed, c["tp_rank"], c["dp_rank"], c["pp_rank"]).items():
        tracker.add(name, s)


def find_rng_tracker(module: nn.Module) -> RNGStatesTracker | None:
    """The tensor-parallel RNG tracker used by ``module`` (a tensor-parallel model, or a pipeline
    StageModel holding some of its layers), or None when it has no tensor-parallel dropout."""
    tracker = getattr(module, "tp_rng_tracker", None)
    if tracker is not None:
        return tracker
    return next((m.tracker for m in module.modules() if isinstance(m, TrackedDropout)), None)


def tracker_checkpoint_state(tracker: RNGStatesTracker) -> dict:
    """What a checkpoint keeps of ``tracker`` for this rank: ``{"states": {name: ByteTensor},
    "coords": {"tp", "tp_rank", "dp_rank", "pp_rank"}}``."""
    return {"states": tracker.get_states(), "coords": dict(tracker.coords)}


def restore_tracker(tracker: RNGStatesTracker, saved: dict | None, step: int) -> str | None:
    """Restore ``tracker`` from :func:`tracker_checkpoint_state` of the rank with the same index in
    the checkpoint of optimizer step ``step``. The states only mean the same stream when that rank
    had the same coordinate (tp degree, tp/dp/pp rank); otherwise (another layout, or a checkpoint
    without tracker states, e.g. saved at tp 1) the tracker is re-seeded from ``seed + step``
    (:func:`seed_tracker`) -- training continues, but its dropout masks differ from an
    uninterrupted run's. Returns None when restored, else a one-line message saying so."""
    if saved is not None and saved.get("coords") == tracker.coords:
        tracker.set_states(saved["states"])
        return None
    seed_tracker(tracker, tracker.seed + int(step))

    def where(c):
        return f"tp {c['tp']} (tp rank {c['tp_rank']}, dp rank {c['dp_rank']}, pp rank {c['pp_rank']})"
    was = "no tensor-parallel RNG state" if saved is None else f"was saved at {where(saved['coords'])}"
    return (f"zerotron: this rank's checkpoint {was}, now {where(tracker.coords)}: tensor-parallel dropout "
            f"RNG re-seeded from train.seed + step {step} (masks differ from an uninterrupted run)")


class TrackedDropout(nn.Module):
    """Dropout (any shape) drawing its mask from ``tracker``: state "replicated" (same mask on every
    tp rank), or "model-parallel" when ``sequence_parallel`` (each rank holds different positions)."""

    def __init__(self, p: float, tracker: RNGStatesTracker, sequence_parallel: bool = False):
        super().__init__()
        self.p, self.tracker, self.sequence_parallel = p, tracker, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork(MODEL_PARALLEL if self.sequence_parallel else REPLICATED):
            return F.dropout(x, self.p, True)


class TPHooks(ParallelHooks):
    """The :class:`~zerotron.models.base.ParallelHooks` of a tensor-parallel model: this rank's
    sequence shard under SP, vocab-sharded logits (B, T, V_pad/tp) from ``forward``, and full
    logits (B, T, V) with SP off inside ``generate`` (T = 1 steps)."""

    def __init__(self, model: nn.Module, tp_group, vocab_size: int, embedding: nn.Module):
        self.model, self.group, self.vocab_size = weakref.ref(model), tp_group, vocab_size
        self.embedding = weakref.ref(embedding)  # its sequence_parallel flag decides (also in a pipeline)
        self.full_logits = False

    def seq_shard(self) -> tuple[int, int]:
        emb = self.embedding()
        return (self.group.rank(), self.group.size()) if emb is not None and emb.sequence_parallel else (0, 1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return gather_logits(x, self.vocab_size, self.group) if self.full_logits else x

    @contextlib.contextmanager
    def generation(self):
        model = self.model()
        sp = model.sequence_parallel
        set_sequence_parallel(model, False)
        self.full_logits = True
        try:
            yield
        finally:
            self.full_logits = False
            set_sequence_parallel(model, sp)


def _model_parallel_fork(tracker: RNGStatesTracker):
    return lambda: tracker.fork(MODEL_PARALLEL)


def apply_tensor_parallel(model: CausalLM, tp_group, sequence_parallel: bool = False, seed: int = 0,
                          dp_rank: int = 0, pp_rank: int = 0) -> CausalLM:
    """Shard ``model`` in place over ``tp_group`` (a comm.NamedGroup) as its ``layout()`` says; returns it.

    The model must be the dense, fully initialised one, identical on every tp rank; each rank keeps
    its slices, so the weights equal the dense model's. The token embedding becomes vocab-parallel,
    the output head a column-parallel projection over the same (padded) vocabulary shard (tied to the
    embedding when the layout ties them), every Linear of ``layout.block_tp`` column/row parallel,
    each LoRA adapter split like its base (``tensor.adapters``), frozen parameters kept frozen,
    every ``nn.Dropout`` a :class:`TrackedDropout`, each attention's ``dropout_rng`` the
    "model-parallel" stream, and ``model.parallel_hooks`` a :class:`TPHooks`. Sets
    ``model.tp_group``, ``model.tp_rng_tracker``, ``model.sequence_parallel``. ``seed``,
    ``dp_rank``, ``pp_rank`` (this rank's mesh coordinates) seed the dropout RNG tracker
    (:func:`tp_rng_seeds`). With SP, modules taking statistics over a forward's tokens (MoE
    routers) sum them over tp (``models.layout.add_token_sum``). Raises ValueError if tp does not divide a size of ``layout.tp_divides``
    or the model is already tensor-parallel, TypeError if it has no layout."""
    if not callable(getattr(model, "layout", None)):
        raise TypeError(f"apply_tensor_parallel expects a model with a layout(), got {type(model).__name__}")
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("model is already tensor-parallel")
    lay, n, rank = model.layout(), tp_group.size(), tp_group.rank()
    lay.check_tp(n)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    emb = get_module(model, lay.token_embedding)
    deferred = getattr(model, "deferred_init", None)  # a meta-device model: its streams live where it will
    tracker = RNGStatesTracker(deferred.device if deferred is not None else emb.weight.device)
    tracker.seed, tracker.coords = int(seed), {"tp": n, "tp_rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank}
    seed_tracker(tracker, seed)
    sp = sequence_parallel
    out = get_module(model, lay.output)
    tied = out.weight is emb.weight
    vemb = VocabParallelEmbedding.from_dense(emb, tp_group, sp)
    vemb.comm_tag = "tp_embed"
    set_module(model, lay.token_embedding, vemb)
    if tied:
        head = ColumnParallelLinear.tied(vemb.weight, tp_group, sp)
    else:
        head = ColumnParallelLinear.from_dense(out, tp_group, sequence_parallel=sp,
                                               padded_size=vemb.padded_num_embeddings)
    head.comm_tag = "tp_head"
    set_module(model, lay.output, head)
    for block in get_module(model, lay.blocks):
        for path, rule in lay.block_tp.items():
            dense = get_module(block, path)
            if rule.style == "column":
                layer = ColumnParallelLinear.from_dense(dense, tp_group, sequence_parallel=sp, chunks=rule.chunks)
            else:
                layer = RowParallelLinear.from_dense(dense, tp_group, sequence_parallel=sp)
            layer.comm_tag = "tp_block"
            shard_adapter(dense, layer, rule.style, rule.chunks, tp_group, tracker)  # LoRA: split like its base
            set_module(block, path, layer)
        get_module(block, lay.attention).dropout_rng = _model_parallel_fork(tracker)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Dropout):
            set_module(model, name, TrackedDropout(m.p, tracker, sp))
    for name, p in model.named_parameters(remove_duplicate=False):  # frozen (LoRA base) stays frozen
        if name in frozen:
            p.requires_grad_(False)
    model.tp_group, model.tp_rng_tracker, model.sequence_parallel = tp_group, tracker, sp
    model.parallel_hooks = TPHooks(model, tp_group, lay.vocab_size, vemb)
    if sp:  # per-micro-batch token statistics (MoE routers) over the sequence shards of the tp group
        add_token_sum(model, comm.summer(tp_group, "moe_aux"))
    return model


def set_sequence_parallel(model: nn.Module, enabled: bool) -> None:
    """Switch sequence parallelism of a TP model on/off (weights are the same either way; e.g. off
    for evaluation on lengths not divisible by tp). Call sync_replicated_grads for steps run with SP."""
    for m in model.modules():
        if isinstance(m, _TP_LAYERS + (TrackedDropout,)):
            m.sequence_parallel = enabled
    model.sequence_parallel = enabled


def sync_replicated_grads(model: nn.Module) -> int:
    """With sequence parallelism, sum over tp the gradients of tp-replicated parameters (LayerNorms,
    row-parallel biases, wpe): each rank only saw its sequence shard (Korthikanti et al. 2022).
    One coalesced all-reduce per dtype ["tp_grad"]. The trainer calls it once after the last
    backward of a step, before clipping/optimizer (sums over tp and dp commute, so before or after
    the dp reduction). Reduces in the gradients' own dtype: the fp32 parameter dtype of the DDP
    layouts that call it (``parallel.reduce_dtype`` must then be fp32, zerotron.plan); ZeRO sums
    its dp shards in the reduce dtype instead. No-op (returns 0) without SP or with tp = 1; else
    returns elements reduced. FSDP2 (DTensor) gradients: their local dp shards are summed (the same
    elements on every tp rank of one dp coordinate), after FSDP2's reduce-scatter."""
    group = model.tp_group
    if not model.sequence_parallel or group.size() == 1:
        return 0
    grads = [_local(p.grad) for p in model.parameters() if not is_tp_sharded(p) and p.grad is not None]
    comm.assert_idle(grads, "sync_replicated_grads")  # e.g. a DDP bucket all-reduce still writing them
    total = 0
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        comm.all_reduce(flat, group=group, tag="tp_grad")
        for g, chunk in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(chunk.view_as(g))
        total += flat.numel()
    return total


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g  # an FSDP2 (DTensor) gradient: this rank's shard


def clip_grad_norm_tp(parameters, max_norm: float, tp_group) -> float:
    """Global L2 gradient norm of ``parameters`` over tp (shards summed over tp, replicated ones
    counted once), clipped in place when ``max_norm > 0``: the one rule of
    :func:`zerotron.parallel.grad_norm.clip_grad_norm`. Collective over tp."""
    ps = [p for p in parameters if p.grad is not None]
    return clip_grad_norm([([p.grad for p in ps if is_tp_sharded(p)], [tp_group]),
                           ([p.grad for p in ps if not is_tp_sharded(p)], [])], max_norm)


def gather_logits(logits_local: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """All-gather vocab-sharded logits (B, T, V_pad/tp) -> (B, T, V), padding columns dropped
    (differentiable; backward keeps this rank's slice). Tag "tp_logits"."""
    return gather_from_tp(logits_local, tp_group, "tp_logits")[..., :vocab_size].contiguous()


def tp_loss_sum(model: nn.Module, logits_local: torch.Tensor, targets: torch.Tensor,
                label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """SUM of token cross-entropies of ``model``'s vocab-sharded logits (B, T, V_pad/tp) against
    targets (B, T): :func:`vocab_parallel_cross_entropy` with this rank's vocab range. The trainer
    divides by the global number of target tokens itself."""
    lay = model.layout()
    per = get_module(model, lay.output).weight.size(0)  # this rank's vocabulary rows V_pad/tp
    return vocab_parallel_cross_entropy(logits_local, targets, model.tp_group.rank() * per, lay.vocab_size,
                                        model.tp_group, ignore_index, label_smoothing)


def tp_state_dict_full(model: nn.Module) -> dict:
    """Dense state dict (same keys, shapes and tied entries as the dense model's, padding removed) on
    every tp rank; one all-gather per sharded tensor ["tp_export"], so every tp rank must call it.
    Replicated entries share storage with the parameters, as in ``state_dict()``. For optimizer
    states use ``full_tensor(param, tp_group, local=state_tensor)``."""
    out, seen = {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen[id(t)] = full_tensor(t, model.tp_group)
        out[key] = seen[id(t)]
    return out


def load_dense_into_tp(model: nn.Module, state_dict: dict) -> None:
    """Copy this rank's slices of a dense model state dict into ``model`` (no communication). Raises
    KeyError for missing/unexpected keys, ValueError for a dense shape that does not fit."""
    own = model.state_dict(keep_vars=True)
    missing, extra = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    if missing or extra:
        raise KeyError(f"dense state dict does not match the model: missing {missing}, unexpected {extra}")
    n = model.tp_group.size()
    with torch.no_grad():
        for key, p in own.items():
            src = state_dict[key].to(device=p.device, dtype=p.dtype)
            if is_tp_sharded(p):
                meta = p.tp_shard
                dim, padded = meta.dim, p.size(meta.dim) * n
                want = list(p.shape)
                want[dim] = meta.full_size if meta.full_size is not None else padded
                if list(src.shape) != want:
                    raise ValueError(f"{key}: dense shape {tuple(src.shape)} != expected {tuple(want)}")
                src = shard_tensor(src, dim, model.tp_group, meta.chunks, padded)
            elif src.shape != p.shape:
                raise ValueError(f"{key}: dense shape {tuple(src.shape)} != expected {tuple(p.shape)}")
            p.copy_(src)


__all__ = ["apply_tensor_parallel", "set_sequence_parallel", "sync_replicated_grads", "clip_grad_norm_tp",
           "gather_logits", "tp_loss_sum", "tp_state_dict_full", "load_dense_into_tp", "is_tp_sharded",
           "RNGStatesTracker", "TrackedDropout", "tp_rng_seeds", "seed_tracker", "find_rng_tracker",
           "tracker_checkpoint_state", "restore_tracker", "TPHooks",
           "MODEL_PARALLEL", "REPLICATED"]
