"""The contract every zerotron model family keeps: :class:`CausalLM`, :class:`KVCache`,
:class:`ParallelHooks`.

A model is a decoder-only causal LM split into an embedding, a list of residual blocks and a head,
described by :meth:`CausalLM.layout` (a :class:`zerotron.models.layout.ModelLayout`). The parallel
engine transforms the modules in place (e.g. a Linear becomes a column-parallel one) and installs
:class:`ParallelHooks` for the two things the model's own forward must honour:

  * ``seq_shard()`` -> (index, count): under sequence parallelism (Korthikanti et al. 2022) the
    token embedding returns this rank's ``T/count`` positions ``index*T/count ...``, and any
    position-dependent term added in ``embed`` (learned positions) must use those positions;
  * ``logits(x)``: what ``forward`` returns for the head's output (TP: the vocab shards, or the
    gathered full logits while generating);
  * ``generation()``: a context manager ``generate`` runs in (TP: sequence parallelism off, full
    logits; CP: context parallelism off, every cp rank decodes the whole sequence);
  * ``positions(T, device)``: the global positions (1, T) int64 of the T tokens a full-sequence
    forward (no KV cache) receives, or None for 0 .. T-1 (context parallelism: this rank's zigzag
    chunks of the sequence); learned position embeddings and RoPE use them;
  * ``attention(q, k, v, dropout_p, pad)``: the causal attention every attention module calls
    (dense default :func:`causal_attention`; CP: attention of the local chunks against the whole
    sequence, ``zerotron.parallel.context``).

The attention modules read ``positions`` and ``attention`` from their own ``parallel_hooks``
attribute (default the dense hooks), which a transform changing them sets on every
``layout().attention`` module as well as on the model.

Attention modules compute their local head count from tensor shapes (``view(B, T, -1, D)``), so a
column-parallel projection that keeps ``H/tp`` heads needs no other change, and draw their
attention-probability dropout inside ``self.dropout_rng()`` (a zero-argument callable returning a
context manager; TP points it at its model-parallel RNG stream). Dropout elsewhere is ``nn.Dropout``
(TP swaps each for one drawing from its tracked streams). Non-persistent buffers (e.g. RoPE tables)
are rebuilt by :meth:`CausalLM.init_buffers`, which the engine calls after materialising a model
from the meta device.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import attn_dropout
from .layout import ModelLayout

__all__ = ["KVCache", "ParallelHooks", "CausalLM"]


class KVCache:
    """Per-layer key/value tensors for incremental decoding.

    ``keys[i]`` and ``values[i]`` have shape (B, H_kv, T_cached, D) (H_kv local kv heads). Attention
    layer ``i`` calls ``update(i, k, v)`` with the new (B, H_kv, T_new, D) keys/values and attends to
    what it returns; ``cached(i)`` is layer i's cached length (the absolute position of its next
    token, for rotary embeddings).

    A batch of prompts of different lengths is left-padded: ``pad`` (B,) int64 is the number of
    padding slots at the front of each row (None: no padding, every row starts at slot 0). Slot j of
    row b then holds position ``j - pad[b]`` (:meth:`positions`), and attention masks the padding
    keys (:func:`causal_attention` with ``pad``), so each row computes what it would alone.
    """

    def __init__(self, n_layer: int, pad: torch.Tensor | None = None):
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.pad = pad

    def __len__(self) -> int:
        """Number of cached positions (of layer 0; all layers agree between forward calls)."""
        return self.cached(0)

    def cached(self, layer: int) -> int:
        """Cached positions of ``layer``."""
        return 0 if self.keys[layer] is None else self.keys[layer].size(2)

    def positions(self, T: int, layer: int) -> torch.Tensor | None:
        """Per-row positions (B, T) int64 of the T tokens that follow ``layer``'s cached slots
        (padding slots clamp to 0), or None without ``pad`` (positions cached(layer) onward)."""
        if self.pad is None:
            return None
        start = self.cached(layer)
        pos = torch.arange(start, start + T, device=self.pad.device)[None, :] - self.pad[:, None]
        return pos.clamp_(min=0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (B, H_kv, T_new, D) for ``layer``; return all cached (B, H_kv, T_total, D)."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def reset(self) -> None:
        """Drop every cached tensor."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)


class ParallelHooks:
    """The dense (single-process) behaviour of the hooks a parallel engine may replace."""

    def seq_shard(self) -> tuple[int, int]:
        """(index, count) of this rank's sequence shard; (0, 1) = the whole sequence."""
        return 0, 1

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head output (B, T, V) as ``forward`` returns it."""
        return x

    def generation(self):
        """Context of ``generate``."""
        return contextlib.nullcontext()

    def positions(self, T: int, device=None) -> torch.Tensor | None:
        """Global positions (1, T) int64 of a full-sequence forward's T tokens; None = 0 .. T-1."""
        return None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                  pad: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention q (B, H, T, D), k/v (B, H_kv, S, D) -> (B, H, T, D): :func:`causal_attention`."""
        return causal_attention(q, k, v, dropout_p, pad)


DENSE = ParallelHooks()


class WrappingHooks(ParallelHooks):
    """Hooks layered over ``inner`` (installed before them, e.g. tensor parallelism's): the shard
    and logits hooks delegate to ``inner``, and ``generation()`` runs inside ``inner``'s with
    ``self.active`` False, so a wrapper that changes full-sequence training forwards (context
    parallelism, document masking) steps aside while decoding. Positions and attention stay
    ``inner``'s unless a subclass overrides them."""

    def __init__(self, inner: ParallelHooks):
        self.inner, self.active = inner, True

    def seq_shard(self) -> tuple[int, int]:
        return self.inner.seq_shard()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(x)

    @contextlib.contextmanager
    def generation(self):
        self.active = False
        try:
            with self.inner.generation():
                yield
        finally:
            self.active = True

    def positions(self, T: int, device=None) -> torch.Tensor | None:
        return self.inner.positions(T, device)

    def attention(self, q, k, v, dropout_p: float, pad=None):
        return self.inner.attention(q, k, v, dropout_p, pad)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                     pad: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention of the T newest queries over S >= T keys: q (B, H, T, D),
    k/v (B, H_kv, S, D) with H a multiple of H_kv (grouped-query attention, Ainslie et al. 2023:
    each kv head serves H/H_kv query heads) -> (B, H, T, D). Query i sits at absolute position
    S - T + i and sees keys 0 .. S - T + i; scores scaled by 1/sqrt(D) (Vaswani et al. 2017).
    ``pad`` (B,) int64 (left padding, see :class:`KVCache`): row b's keys 0 .. pad[b]-1 are masked
    (a padding query still sees itself, so no row of the softmax is empty). ``dropout_p`` > 0: torch's
    fused dropout, or the coordinate-function mask of :mod:`.attn_dropout` (slots as positions)
    when that is forced (``attn_dropout.forced()``)."""
    T, S = q.size(2), k.size(2)
    if dropout_p > 0 and attn_dropout.forced():  # coordinate-function dropout mask (models.attn_dropout)
        slots = torch.arange(S, device=q.device)
        allowed = slots[None, :] <= slots[S - T:, None]  # (T, S) causal over the slots
        if pad is not None:
            allowed = (allowed[None] & (slots[None, None, :] >= pad[:, None, None])) | (slots[None, :] == slots[S - T:, None])
            allowed = allowed[:, None]
        drop = attn_dropout.AttnDropout(dropout_p, attn_dropout.draw_key())
        return attn_dropout.coordinate_attention(q, k, v, allowed, drop, slots[S - T:], slots)
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask, causal = None, False
    if pad is not None:
        qpos = torch.arange(S - T, S, device=q.device)[:, None]  # (T, 1) slots of the queries
        kpos = torch.arange(S, device=q.device)[None, :]  # (1, S)
        real = kpos[None] >= pad[:, None, None]  # (B, 1, S)
        mask = ((kpos <= qpos)[None] & real) | (kpos == qpos)[None]  # (B, T, S)
        mask = mask[:, None]  # (B, 1, T, S), broadcast over heads
    elif S == T:
        causal = True
    elif T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)


class CausalLM(nn.Module):
    """Base of zerotron's model families: token ids (B, T) -> next-token logits (B, T, V).

    Subclasses set ``self.config`` (with at least ``vocab_size``, ``block_size``, ``n_layer``,
    ``n_embd``) and implement :meth:`layout`, :meth:`embed` and :meth:`head`; blocks are called
    ``block(x, kv_cache)``. ``forward`` and ``generate`` are shared. ``parallel_hooks`` is
    :class:`ParallelHooks` until a parallel engine installs its own."""

    parallel_hooks: ParallelHooks = DENSE

    def layout(self) -> ModelLayout:
        raise NotImplementedError

    def embed(self, idx: torch.Tensor, start_pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> (B, T, C) (or this rank's sequence shard, see ParallelHooks);
        ``positions`` (B, T) int64: per-row positions (left-padded batches) instead of start_pos."""
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> logits (B, T, V)."""
        raise NotImplementedError

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after ``to_empty``). Default: none to rebuild."""

    def blocks(self) -> nn.ModuleList:
        from .layout import get_module
        return get_module(self, self.layout().blocks)

    def check_positions(self, idx: torch.Tensor, start_pos: int) -> None:
        """Raise ValueError if idx is not (B, T) or start_pos + T > block_size."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        T = idx.size(1)
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence too long: start_pos {start_pos} + length {T} = "
                             f"{start_pos + T} > block_size {self.config.block_size}")
        index, count = self.parallel_hooks.seq_shard()
        if count > 1 and T % count:
            raise ValueError(f"sequence parallelism needs T divisible by tp: T={T}, tp={count}; pad the "
                             "sequence or switch sequence parallelism off")

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V), float; no loss here (the trainer computes it).

        With ``kv_cache`` the tokens continue the cached sequence (positions len(cache) onward)
        and the cache grows by T. Raises ValueError if len(cache) + T > block_size.
        """
        if kv_cache is not None and kv_cache.pad is not None:
            x = self.embed(idx, start_pos=len(kv_cache), positions=kv_cache.positions(idx.size(1), 0))
        else:
            x = self.embed(idx, start_pos=len(kv_cache) if kv_cache is not None else 0)
        for block in self.blocks():
            x = block(x, kv_cache)
        return self.parallel_hooks.logits(self.head(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Autoregressive sampling: idx (B, T0) -> (B, T0 + max_new_tokens) int64.

        One prefill forward, then one token per step through a KVCache. ``temperature == 0`` is
        greedy argmax (deterministic); otherwise logits / temperature, optionally restricted to
        the ``top_k`` largest, are sampled with ``torch.multinomial(generator=generator)``.
        Context cropping: the model only sees the last block_size tokens. When the cache is full,
        it is rebuilt from the last block_size tokens (positions restart at 0), exactly what a
        no-cache loop over ``idx[:, -block_size:]`` computes; past that point each step is a
        full forward. Dropout is active if the model is in training mode: call ``eval()`` first.
        Under tensor parallelism every tp rank must call it with the same prompt and an identically
        seeded ``generator`` (or temperature 0). Raises ValueError for an empty prompt, negative
        max_new_tokens/temperature or top_k < 1.
        """
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"idx must have shape (B, T0) with T0 >= 1, got {tuple(idx.shape)}")
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, top_k >= 1; got "
                             f"{max_new_tokens}, {temperature}, {top_k}")
        block_size = self.config.block_size
        with self.parallel_hooks.generation():
            cache = KVCache(self.config.n_layer)
            next_input = idx[:, -block_size:]
            for _ in range(max_new_tokens):
                if len(cache) + next_input.size(1) > block_size:  # window full: re-prefill, cropped
                    cache.reset()
                    next_input = idx[:, -block_size:]
                logits = self(next_input, kv_cache=cache)[:, -1, :].float()  # (B, V)
                if temperature == 0:
                    next_token = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_token = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat([idx, next_token], dim=1)
                next_input = next_token
        return idx
