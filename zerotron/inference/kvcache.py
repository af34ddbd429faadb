"""A preallocated KV cache for decoding: :class:`StaticKVCache`.

``models.base.KVCache`` grows by ``torch.cat`` on every step, which copies every cached key and
value of the layer once per new token (O(T) bytes moved per token, O(T^2) per sequence). Here each
layer's keys and values live in one buffer (B, H_kv, capacity, D) allocated at the first update;
a step writes its new slots in place and attention reads the view of the filled slots. The
capacity is known when a batch is (re)prefilled: the padded prompt length plus the most new tokens
any row still needs, capped at ``block_size`` (past it the engine rebuilds the cache anyway, see
``zerotron.inference.batch``). Values are the same as with the growing cache: only where they are
stored changes.
"""
from __future__ import annotations

import torch

from zerotron.models.base import KVCache

__all__ = ["StaticKVCache", "merge_caches", "keep_rows"]


class StaticKVCache(KVCache):
    """A :class:`KVCache` of ``n_layer`` layers whose keys/values are preallocated buffers of
    ``capacity`` slots (``keys[i]``: (B, H_kv, capacity, D) once layer i has been updated).
    ``pad`` (B,) int64: left padding per row, as in KVCache. Raises ValueError when an update
    would pass ``capacity`` slots or capacity < 1."""

    def __init__(self, n_layer: int, pad: torch.Tensor | None, capacity: int):
        if capacity < 1:
            raise ValueError(f"StaticKVCache needs capacity >= 1, got {capacity}")
        super().__init__(n_layer, pad)
        self.capacity = capacity
        self.lengths = [0] * n_layer

    def cached(self, layer: int) -> int:
        """Filled slots of ``layer``."""
        return self.lengths[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, T_new, D) after ``layer``'s filled slots; return views of all
        filled slots (B, H_kv, T_total, D)."""
        n, t = self.lengths[layer], k.size(2)
        if n + t > self.capacity:
            raise ValueError(f"KV cache of layer {layer} full: {n} + {t} slots > capacity {self.capacity}")
        if self.keys[layer] is None:
            b, h, _, d = k.shape
            self.keys[layer] = k.new_empty(b, h, self.capacity, d)
            self.values[layer] = v.new_empty(b, v.size(1), self.capacity, v.size(3))
        self.keys[layer][:, :, n:n + t].copy_(k)
        self.values[layer][:, :, n:n + t].copy_(v)
        self.lengths[layer] = n + t
        return self.keys[layer][:, :, :n + t], self.values[layer][:, :, :n + t]

    def reset(self) -> None:
        """Drop every cached tensor."""
        super().reset()
        self.lengths = [0] * len(self.lengths)


def _filled(c: StaticKVCache) -> int:
    return max(c.lengths, default=0)


def merge_caches(caches: list[StaticKVCache], capacity: int) -> StaticKVCache:
    """Rows of ``caches`` (in order) in one new :class:`StaticKVCache` of ``capacity`` slots, for
    continuous batching (rows joining a running batch). Every cache keeps its rows' newest token in
    its last filled slot; the merged cache right-aligns them at S = the most filled slots of any
    input, adding ``S - S_i`` padding slots in front of cache i's rows (its ``pad`` grows by as
    much: the positions ``slot - pad`` and so every row's values are unchanged). Padding slots
    hold zeros (masked by attention; zeros, not garbage, since a masked value still multiplies 0).
    Layers not held here (None in every input) stay None. Raises ValueError for S > capacity or
    caches that disagree on the layers they hold."""
    n_layer = len(caches[0].keys)
    S = max(_filled(c) for c in caches)
    if S > capacity:
        raise ValueError(f"merge_caches: {S} filled slots do not fit a capacity of {capacity}")
    held = [i for i in range(n_layer) if caches[0].keys[i] is not None]
    if any([i for i in range(n_layer) if c.keys[i] is not None] != held for c in caches):
        raise ValueError("merge_caches: the caches hold different layers")
    pads = []
    for c in caches:
        b = c.keys[held[0]].size(0) if held else 0
        p = c.pad if c.pad is not None else torch.zeros(b, dtype=torch.long, device=c.keys[held[0]].device)
        pads.append(p + (S - _filled(c)))
    out = StaticKVCache(n_layer, torch.cat(pads), capacity)
    for i in held:
        for src, dst in ((lambda c: c.keys[i], out.keys), (lambda c: c.values[i], out.values)):
            parts = [src(c) for c in caches]
            B = sum(t.size(0) for t in parts)
            buf = parts[0].new_zeros(B, parts[0].size(1), capacity, parts[0].size(3))
            lo = 0
            for c, t in zip(caches, parts):
                n = _filled(c)
                buf[lo:lo + t.size(0), :, S - n:S].copy_(t[:, :, :n])
                lo += t.size(0)
            dst[i] = buf
        out.lengths[i] = S
    return out


def keep_rows(c: StaticKVCache, rows: list[int]) -> StaticKVCache:
    """A new :class:`StaticKVCache` (same capacity) holding only ``rows`` (indices into ``c``'s
    batch, in that order), with the leading slots that are padding in every kept row dropped
    (rows leaving a continuous batch; the rest keep their values and positions)."""
    dev = next(k.device for k in c.keys if k is not None)
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    pad = c.pad.index_select(0, idx) if c.pad is not None else torch.zeros(len(rows), dtype=torch.long, device=dev)
    drop = int(pad.min()) if len(rows) else 0
    out = StaticKVCache(len(c.keys), pad - drop, c.capacity)
    for i, (k, v) in enumerate(zip(c.keys, c.values)):
        if k is None:
            continue
        n = c.lengths[i]
        for src, dst in ((k, out.keys), (v, out.values)):
            buf = src.new_zeros(len(rows), src.size(1), c.capacity, src.size(3))
            buf[:, :, :n - drop].copy_(src.index_select(0, idx)[:, :, drop:n])
            dst[i] = buf
        out.lengths[i] = n - drop
    return out
