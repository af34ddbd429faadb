"""Expert parallelism at inference: the experts of each MoE layer split over the ep ranks, in one of two
ways (:func:`shard_for_inference`): the ranks of an ep group decode the same rows (``split="replica"``,
:class:`GatherDispatch`), or each decodes its own rows and sends every token to its experts' owners
(``split="tokens"``, the training all-to-all, :class:`Lockstep`).

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

Token split (``split="tokens"``, as expert-parallel serving systems such as DeepSpeed-MoE inference
and SGLang/vLLM's EP do): every rank of the ep group is a data-parallel replica of its own (its own
requests, KV cache and attention), and each MoE layer moves this rank's routed rows to the ranks
holding their experts and back by the all-to-all of training
(:class:`~zerotron.parallel.expert.dispatch.AllToAllDispatch`: counts, then the uneven payload).
Attention is not replicated, and each rank sends only its own tokens' k rows (bytes per layer and
forward: 2 x k x rows x C elements out of this rank, plus E counts). The all-to-all needs every rank
of the group in every forward, while the ranks' loops are data-dependent (rows end at different
steps): a rank with no forward of its own in a step joins its peers' with an empty one
(:meth:`Lockstep.idle_forward`: each MoE layer's exchange with zero rows), so all make the same
number of forwards. A token's expert outputs come back in the order of the dense layer, so its
weighted sum runs as in one process.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zerotron.distributed import comm

__all__ = ["GatherDispatch", "Lockstep", "shard_for_inference"]

SPLITS = ("replica", "tokens")  # how the ranks of an ep group share the decoding (module docstring)


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


class Lockstep:
    """The token-split ep group of one rank (module docstring): keeps the ranks' forwards paired.

    Args: ``model`` (its MoE layers already carry the all-to-all dispatch), ``group`` the ep
    ``comm.NamedGroup``. :meth:`any_active` (one all-reduce of a flag over ep) says whether a peer
    still decodes; :meth:`idle_forward` is this rank's part of one forward without rows of its own."""

    def __init__(self, model: nn.Module, group):
        from zerotron.models.layout import get_module

        layout = model.layout()
        self.group = group
        self.moes = [get_module(b, layout.experts.moe) for b in get_module(model, layout.blocks)]
        self.experts = [get_module(b, layout.experts.experts) for b in get_module(model, layout.blocks)]
        self.n_experts = layout.experts.n_experts
        w = next(iter(self.experts[0].parameters()))
        self.width, self.dtype, self.device = layout.width, w.dtype, w.device

    def any_active(self, active: bool) -> bool:
        """Whether this rank or an ep peer has a forward to run. Collective over ep."""
        flag = torch.tensor([int(active)], dtype=torch.int64, device=self.device)
        comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group, tag="moe_lockstep")
        return bool(flag.item())

    def idle_forward(self) -> None:
        """Each MoE layer's exchange, in model order, with no rows from this rank (it still runs its
        experts on the rows its peers send). Collective over ep."""
        rows = torch.empty((0, self.width), dtype=self.dtype, device=self.device)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=self.device)
        for moe, experts in zip(self.moes, self.experts):
            moe.dispatch(experts, rows, counts)


def shard_for_inference(model: nn.Module, dp_group, ep: int, split: str = "replica") -> tuple[int, Lockstep | None]:
    """Keep this rank's E/ep experts in every MoE layer of ``model`` (dense, identical on every
    rank) over its ep group (``expert_groups``: consecutive ranks of ``dp_group``; every rank of the
    world must call this, in the same order) and install the dispatch of ``split`` (:data:`SPLITS`):
    "replica" :class:`GatherDispatch` (the group decodes the same rows), "tokens" the all-to-all
    (each rank its own rows; the returned :class:`Lockstep` pairs the ranks' forwards). Returns
    ``(ep rank, Lockstep or None)``. Raises ValueError for a model without experts, an ep that does
    not divide them or an unknown split."""
    from zerotron.models.layout import get_module
    from zerotron.parallel.expert.dispatch import shard_experts
    from zerotron.parallel.expert.strategy import expert_groups

    if split not in SPLITS:
        raise ValueError(f"the ep split must be one of {SPLITS}, got {split!r}")
    layout = model.layout()
    ep_group, _, ep_rank = expert_groups(dp_group, ep)
    shard_experts(model, layout, ep_rank, ep, ep_group)  # installs the all-to-all dispatch
    if split == "tokens":
        return ep_rank, Lockstep(model, ep_group)
    for block in get_module(model, layout.blocks):
        get_module(block, layout.experts.moe).dispatch = GatherDispatch(ep_group, ep_rank, layout.experts.n_experts)
    return ep_rank, None
