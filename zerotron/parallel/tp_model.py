"""Tensor/sequence parallelism for ``zerotron.models.gpt.GPT``: an in-place transform plus helpers.

``apply_tensor_parallel(model, tp_group, sequence_parallel, seed)`` takes a fully initialised dense GPT
(identical on every tp rank) and keeps this rank's slices (Shoeybi et al. 2019, "Megatron-LM", sec. 3):
attention ``c_attn`` column-parallel by heads, ``c_proj`` row-parallel; MLP ``c_fc`` column,
``c_proj`` row; ``wte`` vocab-parallel and the tied ``lm_head`` a column-parallel projection over
the same shard, so the model returns vocab-sharded logits (B, T, V_pad/tp). wpe and LayerNorms are
replicated. With ``sequence_parallel`` (Korthikanti et al. 2022, sec. 4.2.2) the replicated
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

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import comm
from ..models.gpt import GPT, CausalSelfAttention, KVCache
from .tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_tensor,
    gather_from_tp,
    is_tp_sharded,
    shard_tensor,
    vocab_parallel_cross_entropy,
)

MODEL_PARALLEL, REPLICATED = "model-parallel", "replicated"
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
    """The tensor-parallel RNG tracker used by ``module`` (a TensorParallelGPT, or a pipeline
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


class TPCausalSelfAttention(CausalSelfAttention):
    """Causal self-attention over this rank's n_head/tp heads (Shoeybi et al. 2019, sec. 3).

    x (B, T, C) [or (B, T/tp, C) with SP] -> c_attn (column, [q_t|k_t|v_t]) -> (B, T, 3C/tp) ->
    heads (B, H/tp, T, D) -> (B, T, C/tp) -> c_proj (row) -> (B, T, C) [or (B, T/tp, C)]. A KVCache
    holds local heads (B, H/tp, S, D). Attention-probability dropout uses the "model-parallel" RNG."""

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        qkv = self.c_attn(x)
        B, T, _ = qkv.shape
        H, D = self.n_head_local, self.n_embd // self.n_head
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        S = k.size(2)
        mask = None
        if S != T and T > 1:  # same masking as the dense CausalSelfAttention
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        p = self.dropout if self.training else 0.0
        with self.rng_tracker.fork(MODEL_PARALLEL) if p > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=S == T, dropout_p=p)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, H * D)))


class TensorParallelGPT(GPT):
    """A GPT after :func:`apply_tensor_parallel`: ``forward(idx (B, T))`` returns vocab-sharded logits
    (B, T, V_pad/tp) (full (B, T, V) inside ``generate``). Raises ValueError if sequence parallel
    is on and T is not divisible by tp."""

    def embed(self, idx: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Vocab-parallel tokens + positions -> (B, T, C), or this rank's (B, T/tp, C) with SP."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        T, n = idx.size(1), self.tp_group.size()
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence too long: start_pos {start_pos} + length {T} > block_size "
                             f"{self.config.block_size}")
        if self.sequence_parallel:
            if T % n:
                raise ValueError(f"sequence parallelism needs T divisible by tp: T={T}, tp={n}; pad the "
                                 "sequence or call set_sequence_parallel(model, False)")
            start_pos, T = start_pos + self.tp_group.rank() * (T // n), T // n
        pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        logits = super().forward(idx, kv_cache)
        return gather_logits(logits, self.config.vocab_size, self.tp_group) if self._full_logits else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """``GPT.generate`` with full logits and SP off (T = 1 steps). Every tp rank must run it with
        the same prompt and an identically seeded ``generator`` (or temperature 0)."""
        sp = self.sequence_parallel
        set_sequence_parallel(self, False)
        self._full_logits = True
        try:
            return super().generate(idx, max_new_tokens, temperature, top_k, generator)
        finally:
            self._full_logits = False
            set_sequence_parallel(self, sp)


def apply_tensor_parallel(model: GPT, tp_group, sequence_parallel: bool = False, seed: int = 0,
                          dp_rank: int = 0, pp_rank: int = 0) -> GPT:
    """Shard ``model`` in place over ``tp_group`` (a comm.NamedGroup); returns it (a TensorParallelGPT).

    The model must be the dense, fully initialised GPT, identical on every tp rank; each rank keeps
    its slices, so the weights equal the dense model's. ``seed``, ``dp_rank``, ``pp_rank`` (this
    rank's mesh coordinates) seed the dropout RNG tracker (:func:`tp_rng_seeds`). Raises ValueError
    if tp does not divide n_head (hence C and 4C) or the model is already tensor-parallel,
    TypeError if not a GPT."""
    if not isinstance(model, GPT):
        raise TypeError(f"apply_tensor_parallel expects a GPT, got {type(model).__name__}")
    if isinstance(model, TensorParallelGPT):
        raise ValueError("model is already tensor-parallel")
    cfg, n, rank = model.config, tp_group.size(), tp_group.rank()
    if cfg.n_head % n or (4 * cfg.n_embd) % n:
        raise ValueError(f"tensor parallel degree tp={n} must divide n_head={cfg.n_head} (and 4*n_embd="
                         f"{4 * cfg.n_embd}): each rank holds n_head/tp whole heads; choose tp among the "
                         f"divisors of {cfg.n_head}")
    tracker = RNGStatesTracker(model.transformer.wte.weight.device)
    tracker.seed, tracker.coords = int(seed), {"tp": n, "tp_rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank}
    seed_tracker(tracker, seed)
    sp, tr = sequence_parallel, model.transformer
    tr.wte = VocabParallelEmbedding.from_dense(tr.wte, tp_group, sp)
    tr.wte.comm_tag = "tp_embed"
    model.lm_head = ColumnParallelLinear.tied(tr.wte.weight, tp_group, sp)
    model.lm_head.comm_tag = "tp_head"
    tr.drop = TrackedDropout(cfg.dropout, tracker, sp)
    for block in tr.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear.from_dense(attn.c_attn, tp_group, sequence_parallel=sp, chunks=3)
        attn.c_proj = RowParallelLinear.from_dense(attn.c_proj, tp_group, sequence_parallel=sp)
        mlp.c_fc = ColumnParallelLinear.from_dense(mlp.c_fc, tp_group, sequence_parallel=sp)
        mlp.c_proj = RowParallelLinear.from_dense(mlp.c_proj, tp_group, sequence_parallel=sp)
        for layer in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj):
            layer.comm_tag = "tp_block"
        attn.resid_dropout = TrackedDropout(cfg.dropout, tracker, sp)
        mlp.dropout = TrackedDropout(cfg.dropout, tracker, sp)
        attn.__class__ = TPCausalSelfAttention
        attn.n_head_local, attn.rng_tracker = cfg.n_head // n, tracker
    model.__class__ = TensorParallelGPT
    model.tp_group, model.tp_rng_tracker, model.sequence_parallel, model._full_logits = tp_group, tracker, sp, False
    for p in model.parameters():
        p.tp_sharded = is_tp_sharded(p)
    return model


def set_sequence_parallel(model: TensorParallelGPT, enabled: bool) -> None:
    """Switch sequence parallelism of a TP model on/off (weights are the same either way; e.g. off
    for evaluation on lengths not divisible by tp). Call sync_replicated_grads for steps run with SP."""
    for m in model.modules():
        if isinstance(m, _TP_LAYERS + (TrackedDropout,)):
            m.sequence_parallel = enabled
    model.sequence_parallel = enabled


def sync_replicated_grads(model: TensorParallelGPT) -> int:
    """With sequence parallelism, sum over tp the gradients of tp-replicated parameters (LayerNorms,
    row-parallel biases, wpe): each rank only saw its sequence shard (Korthikanti et al. 2022).
    One coalesced all-reduce per dtype ["tp_grad"]. The trainer calls it once after the last
    backward of a step, before clipping/optimizer (sums over tp and dp commute, so before or after
    the dp reduction). Reduces in the gradients' own dtype: the fp32 parameter dtype of the DDP
    layouts that call it (``parallel.reduce_dtype`` must then be fp32, config.validate); ZeRO sums
    its dp shards in the reduce dtype instead. No-op (returns 0) without SP or with tp = 1; else
    returns elements reduced."""
    group = model.tp_group
    if not model.sequence_parallel or group.size() == 1:
        return 0
    grads = [p.grad for p in model.parameters() if not is_tp_sharded(p) and p.grad is not None]
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


def clip_grad_norm_tp(parameters, max_norm: float, tp_group) -> float:
    """Global L2 gradient norm over tp: sqrt(all_reduce_tp(sum over sharded ||g||^2) + sum over
    replicated ||g||^2) (sharded counted on every rank, replicated once); clips in place with
    torch's rule g *= min(1, max_norm / (norm + 1e-6)) if max_norm > 0. Returns the norm before
    clipping, equal on every tp rank (as Megatron's clip_grads, which reduces the squared norm over
    the model-parallel group). With pp, or ZeRO-2/3 gradient shards over dp, the caller must also
    sum the squares over those groups. Collective over tp (tag "tp_norm")."""
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")

    dt = torch.float64 if any(p.grad.dtype == torch.float64 for p in params) else torch.float32

    def sq(ps):  # fp32 (fp64 in the fp64 mode) sum of squares
        return sum((p.grad.detach().to(dt).square().sum() for p in ps), torch.zeros((), device=device, dtype=dt))

    sharded = sq([p for p in params if is_tp_sharded(p)]).reshape(1)
    if tp_group.size() > 1:
        comm.all_reduce(sharded, group=tp_group, tag="tp_norm")
    norm = (sharded[0] + sq([p for p in params if not is_tp_sharded(p)])).sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(norm)


def gather_logits(logits_local: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """All-gather vocab-sharded logits (B, T, V_pad/tp) -> (B, T, V), padding columns dropped
    (differentiable; backward keeps this rank's slice). Tag "tp_logits"."""
    return gather_from_tp(logits_local, tp_group, "tp_logits")[..., :vocab_size].contiguous()


def tp_loss_sum(model: TensorParallelGPT, logits_local: torch.Tensor, targets: torch.Tensor,
                label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """SUM of token cross-entropies of ``model``'s vocab-sharded logits (B, T, V_pad/tp) against
    targets (B, T): :func:`vocab_parallel_cross_entropy` with this rank's vocab range. The trainer
    divides by the global number of target tokens itself."""
    wte = model.transformer.wte
    return vocab_parallel_cross_entropy(logits_local, targets, wte.vocab_start, model.config.vocab_size,
                                        model.tp_group, ignore_index, label_smoothing)


def tp_state_dict_full(model: TensorParallelGPT) -> dict:
    """Dense state dict (same keys, shapes and tied entries as the dense GPT's, padding removed) on
    every tp rank; one all-gather per sharded tensor ["tp_export"], so every tp rank must call it.
    Replicated entries share storage with the parameters, as in ``state_dict()``. For optimizer
    states use ``full_tensor(param, tp_group, local=state_tensor)``."""
    out, seen = {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen[id(t)] = full_tensor(t, model.tp_group)
        out[key] = seen[id(t)]
    return out


def load_dense_into_tp(model: TensorParallelGPT, state_dict: dict) -> None:
    """Copy this rank's slices of a dense GPT state dict into ``model`` (no communication). Raises
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
                dim, padded = p.tp_dim, p.size(p.tp_dim) * n
                want = list(p.shape)
                want[dim] = p.tp_full_size if p.tp_full_size is not None else padded
                if list(src.shape) != want:
                    raise ValueError(f"{key}: dense shape {tuple(src.shape)} != expected {tuple(want)}")
                src = shard_tensor(src, dim, model.tp_group, p.tp_chunks, padded)
            elif src.shape != p.shape:
                raise ValueError(f"{key}: dense shape {tuple(src.shape)} != expected {tuple(p.shape)}")
            p.copy_(src)


__all__ = ["apply_tensor_parallel", "set_sequence_parallel", "sync_replicated_grads", "clip_grad_norm_tp",
           "gather_logits", "tp_loss_sum", "tp_state_dict_full", "load_dense_into_tp", "is_tp_sharded",
           "RNGStatesTracker", "TrackedDropout", "tp_rng_seeds", "seed_tracker", "find_rng_tracker",
           "tracker_checkpoint_state", "restore_tracker", "TPCausalSelfAttention", "TensorParallelGPT",
           "MODEL_PARALLEL", "REPLICATED"]
