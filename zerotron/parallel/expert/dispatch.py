"""Token dispatch and combine over the ep group by all-to-all (GShard, Lepikhin et al. 2020;
DeepSpeed-MoE, Rajbhandari et al. 2022), router-agnostic: the MoE layer hands over its rows already
sorted by expert with the per-expert counts, and gets the expert outputs back in the same order.

Experts are split in contiguous ranges: ep rank r holds experts ``r*E/ep .. (r+1)*E/ep - 1``, so the
rows a rank sends to rank j are one contiguous block of its sorted rows. One call:

  1. counts: an equal-split all-to-all of the (ep, E/ep) matrix of rows per (destination rank, its
     local expert) -- afterwards each rank knows how many rows each source sends to each of its
     experts (the uneven split sizes of step 2);
  2. dispatch: an uneven all-to-all of the rows (``comm.all_to_all_v``); they arrive grouped by
     source, then expert, and are permuted to expert-major order (source order inside an expert);
  3. the local experts run (``Experts.forward``, batched per expert);
  4. combine: the inverse permutation and the reverse all-to-all.

Both payload all-to-alls are differentiable (their backward is the reverse exchange), so expert
gradients are sums over the tokens of the whole ep group. Every rank of the ep group must call the
layer the same number of times in the same order (forward, backward, recomputation), as with any
collective.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zerotron.distributed import comm

__all__ = ["AllToAllDispatch", "local_dispatch", "shard_experts"]


def local_dispatch(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this rank: the rows go straight to ``experts(rows, counts)``."""
    return experts(rows, counts)


class _AllToAllV(torch.autograd.Function):
    """Rows (sum(in_splits), C) -> (sum(out_splits), C) over ``group``; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_v(out, x, out_splits, in_splits, group=group, tag="moe_dispatch")
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_v(back, grad, in_splits, out_splits, group=ctx.group, tag="moe_dispatch")
        return back, None, None, None


class AllToAllDispatch:
    """The ``dispatch`` hook of one MoE layer under expert parallelism: ``(experts, rows, counts) ->
    outputs`` with ``rows`` (M, C) sorted by global expert id, ``counts`` (E,) int64 (sum M),
    ``experts`` holding this rank's E/ep experts; returns (M, C) in the order of ``rows``.

    Args: ``group`` the ep ``comm.NamedGroup`` (its rank = this rank's ep coordinate), ``n_experts`` E."""

    def __init__(self, group, n_experts: int):
        self.group, self.ep = group, group.size()
        self.n_experts, self.n_local = n_experts, n_experts // self.ep

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        send = counts.reshape(ep, n_local).contiguous()  # rows to rank j's local expert e
        recv = torch.empty_like(send)
        comm.all_to_all(recv.view(-1), send.view(-1), group=self.group, tag="moe_counts")
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = _AllToAllV.apply(rows, out_splits, in_splits, self.group)  # source-major, then expert
        seg = torch.repeat_interleave(torch.arange(ep * n_local, device=rows.device), recv.reshape(-1).to(rows.device))
        perm = torch.argsort((seg % n_local) * ep + seg // n_local, stable=True)  # -> expert-major
        out = experts(got[perm], recv.sum(0))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return _AllToAllV.apply(out[inv], in_splits, out_splits, self.group)


@torch.no_grad()
def shard_experts(model: nn.Module, layout, ep_rank: int, ep: int, group) -> dict[str, nn.Parameter]:
    """Keep expert range ``ep_rank`` of ``ep`` in every MoE layer of ``model`` (``layout.experts``:
    each parameter of the experts module cut along dim 0 into a new Parameter, tagged
    ``ep_shard = (ep_rank, ep)``) and install :class:`AllToAllDispatch` over ``group``. Returns
    {parameter name: new local Parameter}. Raises ValueError for a model without experts or an ep
    that does not divide them."""
    from zerotron.models.layout import get_module

    spec = layout.experts
    if spec is None:
        raise ValueError("expert parallelism needs a model whose layout declares experts")
    if spec.n_experts % ep:
        raise ValueError(f"ep ({ep}) must divide n_experts ({spec.n_experts})")
    n_local = spec.n_experts // ep
    lo = ep_rank * n_local
    out = {}
    for i, block in enumerate(get_module(model, layout.blocks)):
        experts = get_module(block, spec.experts)
        for name, p in list(experts.named_parameters(recurse=False)):
            q = nn.Parameter(p.data[lo:lo + n_local].clone(), requires_grad=p.requires_grad)
            q.ep_shard = (ep_rank, ep)
            setattr(experts, name, q)
            out[f"{layout.blocks}.{i}.{spec.experts}.{name}"] = q
        get_module(block, spec.moe).dispatch = AllToAllDispatch(group, spec.n_experts)
    return out
