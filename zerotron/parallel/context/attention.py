"""``context_attention``: causal attention of this cp rank's local (zigzag) chunks against the whole
sequence, one interface over the implementations selected by ``parallel.cp_impl``.

Contract (every implementation): q (B, H, T_local, D), k and v (B, H_kv, T_local, D) hold the
tokens of this rank's zigzag split (:mod:`.split`; T_local = T / cp, positions from
``zigzag_positions``); H is a multiple of H_kv (GQA). The result (B, H, T_local, D) equals, row for
row, causal scaled dot-product attention (scale 1/sqrt(D)) over the full sequence restricted to this
rank's query positions. Differentiable in q, k and v (the backward communicates over the same
group). ``group``: the cp group (``Mesh.group("cp")``, a ``comm.NamedGroup``); all traffic goes
through :mod:`zerotron.distributed.comm` so it is counted per op and group.

Attention dropout: a mask that is a pure function of global coordinates (``models.attn_dropout``)
under a key shared by the cp group (:func:`shared_dropout`), so every implementation -- the ring
block by block and again in its backward, all-to-all over its head slice, all-gather over its
zigzag queries -- drops exactly what one process running ``coordinate_attention`` drops. Exact
against one process given the key; embedding and residual dropout act on local tokens with each
rank's own RNG stream (statistically, not bitwise, equivalent to one process).
"""
from __future__ import annotations

import torch

from zerotron.distributed import comm
from zerotron.distributed.groups import group_ranks
from zerotron.models.attn_dropout import AttnDropout, draw_key

__all__ = ["IMPLS", "context_attention", "shared_dropout"]

IMPLS = ("ring", "a2a", "allgather")  # parallel.cp_impl values (= plan.CP_IMPLS); the first is the default


def shared_dropout(p: float, group) -> AttnDropout:
    """The attention dropout of one call under context parallelism: every cp rank draws a key from
    its current RNG stream (``models.attn_dropout.draw_key``: the same consumption on every rank) and
    cp rank 0's key is broadcast over ``group`` (``broadcast``, tag ``cp_dropout``, 8 bytes), so all
    cp ranks apply one mask. Activation checkpointing restores the RNG state before recomputing,
    so the recomputation draws and broadcasts the same key."""
    key = torch.tensor([draw_key()], dtype=torch.int64)
    if group.size() > 1:
        comm.broadcast(key, src=(group_ranks(group) or [0])[0], group=group, tag="cp_dropout")
    return AttnDropout(p, int(key.item()))


def context_attention(q, k, v, group, impl: str = "ring", doc=None, drop: AttnDropout | None = None):
    """Dispatch to the ``impl`` implementation (``.ring.ring_attention``, ``.a2a.a2a_attention`` or
    ``.allgather.allgather_attention``); shapes and semantics in the module doc. ``doc``: None, or
    the document indices (B, T) of the whole sequence in natural order (``.docmask``): a query then
    sees only the keys of its own document. ``drop``: None, or the attention-probability dropout of
    the call (``models.attn_dropout.AttnDropout``, e.g. :func:`shared_dropout`): every
    implementation applies the coordinate-function mask one process applies with the same key
    (``models.attn_dropout.coordinate_attention``). Raises ValueError for an unknown ``impl``."""
    if impl == "ring":
        from .ring import ring_attention
        return ring_attention(q, k, v, group, doc=doc, drop=drop)
    if impl == "a2a":
        from .a2a import a2a_attention
        return a2a_attention(q, k, v, group, doc=doc, drop=drop)
    if impl == "allgather":
        from .allgather import allgather_attention
        return allgather_attention(q, k, v, group, doc=doc, drop=drop)
    raise ValueError(f"unknown parallel.cp_impl {impl!r}; choose one of {IMPLS}")
