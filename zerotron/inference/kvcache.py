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

__all__ = ["StaticKVCache"]


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
