"""The paged engine's decode step compiled (``serve --compile`` with continuous batching):
:class:`CompiledPagedDecode`.

Eagerly, a decode step of the paged engine (:class:`~zerotron.inference.continuous.ContinuousDecoder`)
runs a few hundred small torch ops per step: per layer it writes the new keys/values into the block
pool, gathers every row's whole context through its block table into a left-padded (B, H_kv, S, D)
copy (:class:`~zerotron.inference.paged.PagedView`) and attends to that copy. At 16 rows of the
4-layer, 128-wide GPT-2 of ``bench serve`` that is ~5 ms of CPU per step, a quarter of it the gather.

Here the whole decode forward (embedding, every block, the head) is one ``torch.compile`` graph
(Inductor emits C++ loops on CPU), and attention (:func:`paged_decode_attention`) reads the pool
*in place*, block by block, as vLLM's PagedAttention kernel does (Kwon et al. 2023): the pool is
viewed as (H_kv, blocks, page, D), indexed by the rows' block tables, and the scores, the softmax
and the weighted sum of values are reductions over (blocks, page) with the head dim innermost, which
Inductor fuses with the masking and vectorises along the head dim, each block's keys and values
read once and contiguously. The row's own new key and value stay out of the pool (the softmax over
the cached slots and the new key is merged by their common maximum). Before (session 10), the graph
gathered each row's context slot by slot and appended the new key (a concatenation), so Inductor
copied every layer's context out of the pool once per step; the batcher's CPU per 16-row
iteration is now 0.38-0.65x of that (paired, loaded; ``benchmarks/serve_step_breakdown.md``).

The graph is functional: it reads the pool and returns the logits and every layer's new keys and
values, which the caller writes into their blocks (one ``index_copy_`` per layer and pool) after
the call. Its inputs are the rows' last tokens, their block tables (B, W) and cached lengths (B,)
(the positions), built from the decoder's lists in three ``torch.tensor`` calls: no
:class:`~zerotron.inference.paged.PagedView` and its index arithmetic. Shapes are dynamic (rows B
and table width W vary every step; the page size is a constant of the graph): one graph serves
every step; B and W are padded to at least 2 (Dynamo specialises sizes 0 and 1), the extra row
decoding ``PAD_ID`` with no cached slot and dropped.

Scores are scaled by 1/sqrt(D) (Vaswani et al. 2017); grouped-query heads as
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


def paged_decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, page: int) -> torch.Tensor:
    """One new query per row over its cached slots, read *in place* from the block pool, and over
    its own new key: q (B, H, 1, D), k_new/v_new (B, H_kv, 1, D) (H a multiple of H_kv), keys/values
    the layer's pool (H_kv, num_blocks * page, D), table (B, W) int64 block ids (row b's slot j is
    slot ``j % page`` of block ``table[b, j // page]``; entries past the row's blocks are any valid
    id), lens (B,) int64 cached slots per row (slots >= lens[b] masked) -> (B, H, 1, D). Scores
    scaled by 1/sqrt(D); the softmax over the cached slots and the new key is merged by their
    common maximum (log-sum-exp, as blockwise attention does), so the new key needs no slot.

    Written per block ((H_kv, B, W, page, D) views of whole blocks, the head dim innermost), so that
    inside a compiled graph Inductor reads each block's keys and values once, contiguously, within
    the reductions: no per-step copy of every row's context (the slot-level gather that this
    replaced materialised it first; 0.30 against 0.56 ms CPU per layer at 16 rows of ~200 slots,
    ``benchmarks/serve_step_breakdown.md``)."""
    B, H, _, D = q.shape
    hkv, W = keys.size(0), table.size(1)
    kb = keys.view(hkv, -1, page, D)[:, table]  # (H_kv, B, W, page, D)
    vb = values.view(hkv, -1, page, D)[:, table]
    qg = q.reshape(B, hkv, H // hkv, D).transpose(0, 1) * (1.0 / math.sqrt(D))  # (H_kv, B, rep, D)
    s = (qg[:, :, :, None, None, :] * kb[:, :, None]).sum(-1)  # (H_kv, B, rep, W, page)
    slot = torch.arange(W * page, device=q.device).view(W, page)
    s = s.masked_fill((slot[None] >= lens[:, None, None])[None, :, None], float("-inf"))
    sn = (qg * k_new[:, :, 0].transpose(0, 1)[:, :, None]).sum(-1)  # (H_kv, B, rep): the new key
    m = torch.maximum(s.amax((3, 4)), sn)  # finite: the new key's score is
    e = torch.exp(s - m[..., None, None])
    en = torch.exp(sn - m)
    out = (e[..., None] * vb[:, :, None]).sum((3, 4)) + en[..., None] * v_new[:, :, 0].transpose(0, 1)[:, :, None]
    out = out / (e.sum((3, 4)) + en)[..., None]  # (H_kv, B, rep, D)
    return out.transpose(0, 1).reshape(B, H, 1, D)


class _DecodeHooks(WrappingHooks):
    """The attention of a compiled paged decode: :func:`paged_decode_attention` (decode runs in
    eval mode: no dropout); its ``pad`` argument is the :class:`_PoolBlockView` (the models pass
    ``kv_cache.pad`` through), whose ``layer`` is the one :meth:`_PoolBlockView.update` saw last."""

    def attention(self, q, k, v, dropout_p: float, pad=None):
        view = pad
        i = view.layer
        return paged_decode_attention(q, k, v, view.keys[i], view.values[i], view.table, view.lens,
                                      view.page).to(q.dtype)


class _PoolBlockView(KVCache):
    """The cache the compiled graph sees: per layer the pool's keys/values (H_kv, slots, D), row b's
    ``lens[b]`` cached slots read through its blocks ``table[b]``; :meth:`update` keeps the new
    keys/values (``new_k``/``new_v``) and returns them: the attention hook reads the pool itself.
    ``pad`` is the view (the models hand it to the hook); positions are ``lens`` (each row's own)."""

    def __init__(self, keys, values, table: torch.Tensor, lens: torch.Tensor, page: int):
        self.keys, self.values, self.table, self.lens, self.page = keys, values, table, lens, page
        self.pad = self
        self.layer = 0
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []

    def cached(self, layer: int) -> int:
        return 0  # positions() gives every row's own

    def positions(self, T: int, layer: int) -> torch.Tensor:
        return self.lens[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.new_k.append(k)
        self.new_v.append(v)
        self.layer = layer
        return k, v


def _make_step(page: int):
    """The decode step for blocks of ``page`` slots (a constant of the graph, not a symbol):
    tokens (B, 1), table (B, W), lens (B,) -> (logits (B, V), new keys and values (L, B, H_kv, D) each)."""

    def step(model, blocks, layers, tokens, table, lens, keys, values):
        view = _PoolBlockView(keys, values, table, lens, page)
        logits = forward_layers(model, blocks, layers, tokens, view, True, True)
        return logits, torch.stack([k[:, :, 0] for k in view.new_k]), torch.stack([v[:, :, 0] for v in view.new_v])

    return step


BACKEND = "inductor"  # torch.compile's backend (the tests also run "aot_eager": the same graph, no C++ build)
_compiled: dict = {}


def _entry(page: int):
    key = (BACKEND, page)
    if key not in _compiled:
        import torch._dynamo.config
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # never silently eager
        _compiled[key] = torch.compile(_make_step(page), backend=BACKEND, dynamic=True, fullgraph=True)
    return _compiled[key]


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
        self.fn = _entry(pool.page)
        self.device = next(iter(model.parameters())).device
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
        the first write would) and compile the step on dummy inputs (2 rows of 3 blocks; distinct
        sizes, so Dynamo gives rows and blocks symbols of their own), so that no request waits for
        the compiler. Writes nothing into the pool."""
        pool, n = self.pool, self.pool.num_blocks * self.pool.page
        for i in self.layers:
            if pool.keys[i] is None:
                pool.keys[i] = torch.zeros(kv_heads, n, head_dim, dtype=dtype, device=device)
                pool.values[i] = torch.zeros(kv_heads, n, head_dim, dtype=dtype, device=device)
        with self._installed(), torch.inference_mode():  # as the decoder's steps (grad mode, inference tensors: guarded)
            z = torch.zeros(2, dtype=torch.long, device=device)
            self.fn(self.model, self.blocks, self.layers, torch.full((2, 1), PAD_ID, device=device),
                    torch.zeros(2, 3, dtype=torch.long, device=device), z + 3, pool.keys, pool.values)

    def __call__(self, tokens: list[int], tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """One decode forward of B rows: row b's last token ``tokens[b]`` at position ``lens[b]``
        (its cached slots), its block table ``tables[b]`` (covering slot lens[b], which the new
        key and value are written to) -> logits (B, V)."""
        B, p = len(tokens), self.pool.page
        dst = torch.tensor([t[c // p] * p + c % p for t, c in zip(tables, lens)], device=self.device)
        W = max(2, max(len(t) for t in tables))  # at least two blocks (Dynamo specialises sizes 0 and 1)
        rows = [t + [0] * (W - len(t)) for t in tables]
        if B < 2:  # at least two rows: a padding row decodes PAD_ID with no cached slot
            tokens, rows, lens = tokens + [PAD_ID], rows + [[0] * W], lens + [0]
        with self._installed():
            logits, nk, nv = self.fn(self.model, self.blocks, self.layers,
                                     torch.tensor(tokens, device=self.device)[:, None],
                                     torch.tensor(rows, device=self.device), torch.tensor(lens, device=self.device),
                                     self.pool.keys, self.pool.values)
        for i in self.layers:
            self.pool.keys[i].index_copy_(1, dst, nk[i, :B].transpose(0, 1))
            self.pool.values[i].index_copy_(1, dst, nv[i, :B].transpose(0, 1))
        self.calls += 1
        return logits[:B]
