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

__all__ = ["StaticKVCache", "PooledKVCache"]


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

    def keep_rows(self, idx: torch.Tensor) -> None:
        """Keep only rows ``idx`` (int64, in that order) of every cached layer and of ``pad``."""
        self.keys = [None if k is None else k.index_select(0, idx) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, idx) for v in self.values]
        self.pad = self.pad.index_select(0, idx) if self.pad is not None else None



class PooledKVCache(StaticKVCache):
    """The KV cache of a continuous batch: per layer one buffer (rows, H_kv, capacity, D) of which
    the first ``B`` rows are the running ones, so rows join and leave without copying the others
    (vLLM's idea of fixed slots for requests, Kwon et al. SOSP 2023, with one contiguous block per
    row instead of pages). All running rows end at the same slot S (left padding per row, ``pad``
    (B,) int64, positions ``slot - pad`` as in :class:`~zerotron.models.base.KVCache`):

    * :meth:`append` copies a freshly prefilled cache's rows in after the running ones, right-aligned
      at S (if the newcomers' prompt is longer than S, the running rows shift right once);
    * :meth:`remove` fills the holes of leaving rows with rows from the end (only those are copied)
      and returns the new order;
    * :meth:`trim` drops the leading slots that are padding in every row (when S reaches capacity).

    Slots that are padding may hold stale values of earlier rows: attention masks them, giving
    them a weight of exactly 0 (the buffers start at zero, so every stale value is finite).
    Raises ValueError when an update or an append would pass ``capacity`` slots."""

    def __init__(self, n_layer: int, capacity: int):
        super().__init__(n_layer, None, capacity)
        self.B, self.S = 0, 0
        self.pad = torch.zeros(0, dtype=torch.long)

    def cached(self, layer: int) -> int:
        return self.S if self.keys[layer] is not None else 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, T_new, D) at slots S..S+T_new of the running rows; return the
        views (B, H_kv, S + T_new, D). S itself advances at :meth:`commit`, after the forward."""
        t = k.size(2)
        if self.S + t > self.capacity:
            raise ValueError(f"KV cache of layer {layer} full: {self.S} + {t} slots > capacity {self.capacity}")
        K, V = self.keys[layer], self.values[layer]
        K[:self.B, :, self.S:self.S + t].copy_(k)
        V[:self.B, :, self.S:self.S + t].copy_(v)
        return K[:self.B, :, :self.S + t], V[:self.B, :, :self.S + t]

    def commit(self, t: int) -> None:
        """After a forward of ``t`` new tokens through this rank's layers: those slots are filled."""
        self.S += t

    def _held(self) -> list[int]:
        return [i for i, k in enumerate(self.keys) if k is not None]

    def append(self, fresh: StaticKVCache) -> None:
        """Add the rows of ``fresh`` (a prefilled :class:`StaticKVCache` of the same layers) after
        the running rows."""
        held = [i for i, k in enumerate(fresh.keys) if k is not None]
        n, b = max(fresh.lengths), fresh.keys[held[0]].size(0)
        fpad = fresh.pad if fresh.pad is not None else torch.zeros(b, dtype=torch.long, device=fresh.keys[held[0]].device)
        if n > self.capacity:
            raise ValueError(f"append: {n} slots > capacity {self.capacity}")
        if not self._held() or self.B + b > self.keys[held[0]].size(0):  # (re)allocate the row pool
            rows = max(2 * (self.B + b), 8)
            for i in held:
                for old, new, dst in ((self.keys[i], fresh.keys[i], self.keys), (self.values[i], fresh.values[i],
                                                                                   self.values)):
                    buf = new.new_zeros(rows, new.size(1), self.capacity, new.size(3))
                    if old is not None and self.B:
                        buf[:self.B, :, :self.S].copy_(old[:self.B, :, :self.S])
                    dst[i] = buf
        if n > self.S and self.B:  # the newcomers need more slots: the running rows move right once
            d = n - self.S
            for t in (self.keys[i] for i in held):
                t[:self.B, :, d:n] = t[:self.B, :, :self.S].clone()
            for t in (self.values[i] for i in held):
                t[:self.B, :, d:n] = t[:self.B, :, :self.S].clone()
            self.pad = self.pad + d
        S = max(self.S, n) if self.B else n
        for i in held:
            self.keys[i][self.B:self.B + b, :, S - n:S].copy_(fresh.keys[i][:, :, :n])
            self.values[i][self.B:self.B + b, :, S - n:S].copy_(fresh.values[i][:, :, :n])
        self.pad = torch.cat([self.pad.to(fpad.device), fpad + (S - n)])
        self.S, self.B = S, self.B + b

    def remove(self, rows: list[int]) -> list[int]:
        """Drop running rows ``rows``; returns, for each new row position, the old row index."""
        gone = set(rows)
        order = [i for i in range(self.B) if i not in gone]
        n = len(order)
        holes = [i for i in range(n) if i in gone]
        movers = [i for i in range(n, self.B) if i not in gone]
        perm = list(range(n))
        for h, m in zip(holes, movers):
            for i in self._held():
                self.keys[i][h, :, :self.S].copy_(self.keys[i][m, :, :self.S])
                self.values[i][h, :, :self.S].copy_(self.values[i][m, :, :self.S])
            perm[h] = m
        self.pad = self.pad[torch.tensor(perm, dtype=torch.long, device=self.pad.device)] if n else self.pad[:0]
        self.B = n
        if n == 0:
            self.S = 0
        return perm

    def trim(self) -> int:
        """Drop the leading slots that are padding in every running row; returns how many."""
        m = int(self.pad.min()) if self.B else 0
        if m > 0:
            for i in self._held():
                for t in (self.keys[i], self.values[i]):
                    t[:self.B, :, :self.S - m] = t[:self.B, :, m:self.S].clone()
            self.pad, self.S = self.pad - m, self.S - m
        return m
