"""Expert parallelism at inference: the experts of each MoE layer split over the ep ranks, which
decode the same rows (:func:`shard_for_inference`, :class:`GatherDispatch`).

Training carves the ep group out of the data-parallel ranks, each with its own tokens, and moves
tokens to their experts by all-to-all (:mod:`zerotron.parallel.expert.dispatch`). A decoding loop is
data-dependent (rows finish, join and are preempted at different steps per replica), so here the
ranks of an ep group act as one replica, like the ranks of a tp group: they run the same batch in
lockstep, attention replicated, each holding E/ep experts (a contiguous range, as in training). Every
rank then already has every token: the dispatch is a local slice (the rows sorted by expert are
contiguous per rank) and the combine an all-gather of the expert outputs over ep, which is the
all-to-all whose send buffers are the same for every destination. The outputs come back in the
order of the dense layer, so the weighted sum per token runs in the same order as in one process.

Bytes per MoE layer and step on each rank (comm accounting, tag ``moe_combine``): the all-gather of
ep x max_r(rows of rank r) x C elements (outputs padded to the largest rank's count).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zerotron.distributed import comm

__all__ = ["GatherDispatch", "shard_for_inference"]


class GatherDispatch:
    """The ``dispatch`` hook of one MoE layer at inference under ep (module docstring): ``(experts,
    rows, counts) -> outputs``, ``rows`` (M, C) sorted by global expert id and identical on every
    rank of ``group``, ``counts`` (E,) int64, ``experts`` holding experts ``ep_rank*E/ep ..
    (ep_rank+1)*E/ep - 1``; returns (M, C) in the order of ``rows``. Collective over ``group``
    unless M = 0 (then on every rank, which agree on M)."""

    def __init__(self, group, ep_rank: int, n_experts: int):
        self.group, self.ep, self.ep_rank = group, group.size(), ep_rank
        self.n_local = n_experts // self.ep

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, n_local, r = self.ep, self.n_local, self.ep_rank
        per_rank = counts.reshape(ep, n_local).sum(1).tolist()
        width, most = rows.size(1), max(per_rank)
        if most == 0:
            return rows.new_empty((0, width))
        lo = sum(per_rank[:r])
        mine = experts(rows[lo:lo + per_rank[r]], counts[r * n_local:(r + 1) * n_local])
        buf = mine.new_zeros((most, width))
        buf[:per_rank[r]] = mine
        out = mine.new_empty((ep * most, width))
        comm.all_gather(out.view(-1), buf.view(-1), group=self.group, tag="moe_combine")
        return torch.cat([out[j * most:j * most + per_rank[j]] for j in range(ep)])


def shard_for_inference(model: nn.Module, dp_group, ep: int) -> int:
    """Keep this rank's E/ep experts in every MoE layer of ``model`` (dense, identical on every
    rank) and install :class:`GatherDispatch` over its ep group (``expert_groups``: consecutive
    ranks of ``dp_group``; every rank of the world must call this, in the same order). Returns the
    ep rank. Raises ValueError for a model without experts or an ep that does not divide them."""
    from zerotron.models.layout import get_module
    from zerotron.parallel.expert.dispatch import shard_experts
    from zerotron.parallel.expert.strategy import expert_groups

    layout = model.layout()
    ep_group, _, ep_rank = expert_groups(dp_group, ep)
    shard_experts(model, layout, ep_rank, ep, ep_group)
    for block in get_module(model, layout.blocks):
        get_module(block, layout.experts.moe).dispatch = GatherDispatch(ep_group, ep_rank, layout.experts.n_experts)
    return ep_rank
