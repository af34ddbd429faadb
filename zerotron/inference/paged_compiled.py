"""The paged engine's decode step compiled (``serve --compile`` with continuous batching):
:class:`CompiledPagedDecode`.

Eagerly, a decode step of the paged engine (:class:`~zerotron.inference.continuous.ContinuousDecoder`)
runs a few hundred small torch ops per step: per layer it writes the new keys/values into the block
pool, gathers every row's whole context through its block table into a left-padded (B, H_kv, S, D)
copy (:class:`~zerotron.inference.paged.PagedView`) and attends to that copy. At 16 rows of the
4-layer, 128-wide GPT-2 of ``bench serve`` that is ~5 ms of CPU per step, a quarter of it the gather.

Here the whole decode forward (embedding, every block, the head) is one ``torch.compile`` graph
(Inductor emits C++ loops on CPU), and attention is written as plain reductions over the pool read
through the slot indices (``pool[:, idx]`` scores, softmax, weighted sum of values), which Inductor
fuses with the masking and every elementwise op of the step. What it does *not* do (measured, the
generated code read): read the blocks in place inside the reductions, as vLLM's PagedAttention
kernel does (Kwon et al. 2023). The new key is appended to the context (a concatenation), so
Inductor materialises each layer's context once per step, all layers' copies in the graph's first
kernel; compiled ÷ eager CPU per step was 0.72-0.91 at 16 rows and 0.76-0.82 at 64 (paired, loaded;
README, "The compiled paged decode").

The graph is functional: it reads the pool and returns the logits and every layer's new keys and
values, which the caller writes into their blocks (one ``index_copy_`` per layer and pool) after
the call. Each row's new token attends to its cached slots (read through the table) and to its
own new key, appended as the context's last column. Shapes are dynamic (rows B and context S vary
every step): one graph serves every step; B and S are padded to at least 2 (Dynamo specialises
sizes 0 and 1), the extra row decoding ``PAD_ID`` against fully masked slots and dropped.

Scores are scaled by 1/sqrt(D) (Vaswani et al. 2017); left padding and grouped-query heads as
:func:`zerotron.models.base.causal_attention`; greedy tokens equal the eager engine's (tested in
fp64): only the order of the sums differs.

Layouts: the single process and data parallel (each replica steps its own rows); tensor, pipeline
and expert parallelism (collectives inside the step) are refused with the reason
(:func:`~zerotron.inference.compiled.compile_refusal`).
"""
from __future__ import annotations

import contextlib
import math

import torch

from zerotron.models.base import KVCache, WrappingHooks

from .batch import PAD_ID
from .forward import forward_layers

__all__ = ["CompiledPagedDecode", "paged_decode_attention"]


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """One new query per row over its S keys, as reductions (no fused kernel: inside a compiled
    graph Inductor fuses the keys' gather into the loads): q (B, H, 1, D), k/v (B, H_kv, S, D) with
    H a multiple of H_kv, pad (B,) int64 (row b's keys 0 .. pad[b]-1 masked; key S-1, the query's
    own, is never masked) -> (B, H, 1, D). Scores scaled by 1/sqrt(D)."""
    B, H, _, D = q.shape
    hkv, S = k.size(1), k.size(2)
    qg = q.reshape(B, hkv, H // hkv, 1, D) * (1.0 / math.sqrt(D))
    s = (qg * k[:, :, None]).sum(-1)  # (B, H_kv, rep, S)
    masked = torch.arange(S, device=q.device)[None, :] < pad[:, None]  # (B, S)
    s = s.masked_fill(masked[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = (p[..., None] * v[:, :, None]).sum(-2)  # (B, H_kv, rep, D)
    return out.reshape(B, H, 1, D)


class _DecodeHooks(WrappingHooks):
    """The attention of a compiled paged decode: :func:`paged_decode_attention` (decode runs in
    eval mode: no dropout)."""

    def attention(self, q, k, v, dropout_p: float, pad=None):
        return paged_decode_attention(q, k, v, pad).to(q.dtype)


class _PoolReadView(KVCache):
    """The cache the compiled graph sees: per layer the pool's keys/values (H_kv, slots, D), read
    through ``old`` (B, S - 1) pool slots (row b's cached context left-padded by ``pad[b]``
    slots); the new keys/values are appended as column S - 1 and kept in ``new_k``/``new_v``."""

    def __init__(self, keys, values, old: torch.Tensor, pad: torch.Tensor, pos: torch.Tensor):
        self.keys, self.values, self.old, self.pad, self.pos = keys, values, old, pad, pos
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []

    def cached(self, layer: int) -> int:
        return 0  # positions() gives every row's own

    def positions(self, T: int, layer: int) -> torch.Tensor:
        return self.pos[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        B, S1 = self.old.shape
        self.new_k.append(k)
        self.new_v.append(v)
        out = []
        for pool, new in ((self.keys[layer], k), (self.values[layer], v)):
            ctx = pool[:, self.old.reshape(-1)].reshape(pool.size(0), B, S1, pool.size(2)).transpose(0, 1)
            out.append(torch.cat([ctx, new], dim=2))  # (B, H_kv, S, D)
        return out[0], out[1]


def _step(model, blocks, layers, tokens, pos, old, pad, keys, values):
    """tokens (B, 1), pos (B,), old (B, S - 1), pad (B,) -> (logits (B, V), new keys and values
    (L, B, H_kv, D) each)."""
    view = _PoolReadView(keys, values, old, pad, pos)
    logits = forward_layers(model, blocks, layers, tokens, view, True, True)
    return logits, torch.stack([k[:, :, 0] for k in view.new_k]), torch.stack([v[:, :, 0] for v in view.new_v])


BACKEND = "inductor"  # torch.compile's backend (the tests also run "aot_eager": the same graph, no C++ build)
_compiled: dict = {}


def _entry():
    if BACKEND not in _compiled:
        import torch._dynamo.config
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # never silently eager
        _compiled[BACKEND] = torch.compile(_step, backend=BACKEND, dynamic=True, fullgraph=True)
    return _compiled[BACKEND]


class CompiledPagedDecode:
    """Compiled decode forwards for a paged decoder's dense model (``model``: the whole model of a
    single-process or data-parallel replica; ``attn_modules``: its attention modules, whose hooks
    are wrapped by :class:`_DecodeHooks` for the compiled call only; ``pool``: the decoder's
    :class:`~zerotron.inference.paged.BlockPool`). :meth:`__call__` runs one decode forward."""

    def __init__(self, model, attn_modules, pool):
        self.model, self.pool = model, pool
        self.blocks, self.layers = model.blocks(), list(range(model.config.n_layer))
        self.attn_modules = attn_modules
        self.hooks = [_DecodeHooks(m.parallel_hooks) for m in attn_modules]
        self.fn = _entry()
        self.calls = 0

    @contextlib.contextmanager
    def _installed(self):
        old = [m.parallel_hooks for m in self.attn_modules]
        try:
            for m, h in zip(self.attn_modules, self.hooks):
                m.parallel_hooks = h
            yield
        finally:
            for m, h in zip(self.attn_modules, old):
                m.parallel_hooks = h

    def warm_up(self, kv_heads: int, head_dim: int, dtype, device) -> None:
        """Allocate the pool's layers ((``kv_heads``, slots, ``head_dim``) of ``dtype``, zeroed, as
        the first write would) and compile the step on dummy inputs (2 rows, 3 cached slots; distinct
        sizes, so Dynamo gives rows and slots symbols of their own), so that no request waits for
        the compiler. Writes nothing into the pool."""
        pool, n = self.pool, self.pool.num_blocks * self.pool.page
        for i in self.layers:
            if pool.keys[i] is None:
                pool.keys[i] = torch.zeros(kv_heads, n, head_dim, dtype=dtype, device=device)
                pool.values[i] = torch.zeros(kv_heads, n, head_dim, dtype=dtype, device=device)
        with self._installed(), torch.inference_mode():  # as the decoder's steps (grad mode, inference tensors: guarded)
            z = torch.zeros(2, dtype=torch.long, device=device)
            self.fn(self.model, self.blocks, self.layers, torch.full((2, 1), PAD_ID, device=device), z,
                    torch.zeros(2, 3, dtype=torch.long, device=device), z + 3, pool.keys, pool.values)

    def __call__(self, tokens: torch.Tensor, view) -> torch.Tensor:
        """One decode forward: tokens (B, 1), ``view`` a decode :class:`~zerotron.inference.paged.PagedView`
        (one new token per row, no shared prefix) -> logits (B, V); the new keys/values are
        written to their blocks."""
        B = tokens.size(0)
        old, pad, dst = view.gather[:, :-1], view.pad, view.dst
        pos = view.positions(1, 0)[:, 0]
        if old.size(1) < 2:  # at least two cached columns (left padding: slot 0 of the row, masked)
            k = 2 - old.size(1)
            old = torch.cat([old[:, :1].expand(B, k), old], dim=1)
            pad = pad + k
        if B < 2:  # at least two rows: a padding row decodes PAD_ID with its cached slots masked
            tokens = torch.cat([tokens, torch.full_like(tokens[:1], PAD_ID)])
            pos = torch.cat([pos, pos.new_zeros(1)])
            old = torch.cat([old, old[:1]])
            pad = torch.cat([pad, pad.new_full((1,), old.size(1))])
        with self._installed():
            logits, nk, nv = self.fn(self.model, self.blocks, self.layers, tokens, pos, old.contiguous(), pad,
                                     self.pool.keys, self.pool.values)
        for i in self.layers:
            self.pool.keys[i].index_copy_(1, dst, nk[i, :B].transpose(0, 1))
            self.pool.values[i].index_copy_(1, dst, nv[i, :B].transpose(0, 1))
        self.calls += 1
        return logits[:B]
