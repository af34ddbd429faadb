"""``context_attention``: causal attention of this cp rank's local (zigzag) chunks against the whole
sequence, one interface over the implementations selected by ``parallel.cp_impl``.

Contract (every implementation): q (B, H, T_local, D), k and v (B, H_kv, T_local, D) hold the
tokens of this rank's zigzag split (:mod:`.split`; T_local = T / cp, positions from
``zigzag_positions``); H is a multiple of H_kv (GQA). The result (B, H, T_local, D) equals, row for
row, causal scaled dot-product attention (scale 1/sqrt(D)) over the full sequence restricted to this
rank's query positions. Differentiable in q, k and v (the backward communicates over the same
group). ``group``: the cp group (``Mesh.group("cp")``, a ``comm.NamedGroup``); all traffic goes
through :mod:`zerotron.distributed.comm` so it is counted per op and group.
"""
from __future__ import annotations

__all__ = ["IMPLS", "context_attention"]

IMPLS = ("ring", "a2a", "allgather")  # parallel.cp_impl values (= plan.CP_IMPLS); the first is the default


def context_attention(q, k, v, group, impl: str = "ring", doc=None):
    """Dispatch to the ``impl`` implementation (``.ring.ring_attention``, ``.a2a.a2a_attention`` or
    ``.allgather.allgather_attention``); shapes and semantics in the module doc. ``doc``: None, or
    the document indices (B, T) of the whole sequence in natural order (``.docmask``): a query then
    sees only the keys of its own document. Raises ValueError for an unknown ``impl``."""
    if impl == "ring":
        from .ring import ring_attention
        return ring_attention(q, k, v, group, doc=doc)
    if impl == "a2a":
        from .a2a import a2a_attention
        return a2a_attention(q, k, v, group, doc=doc)
    if impl == "allgather":
        from .allgather import allgather_attention
        return allgather_attention(q, k, v, group, doc=doc)
    raise ValueError(f"unknown parallel.cp_impl {impl!r}; choose one of {IMPLS}")
