"""Tensor (Megatron) and sequence parallelism: the raw collectives and the conjugate autograd
operators f / g (Shoeybi et al. 2019, "Megatron-LM", sec. 3; Korthikanti et al. 2022, sec. 4.2.2).
Layers are in ``tensor.py``, the vocab-parallel cross-entropy in ``tensor/loss.py``; both build on this
module, which imports neither (so any of them can be imported first).

Every collective goes through ``zerotron.distributed.comm`` on ``group`` with ``tag`` in forward
and ``tag + "_bwd"`` in backward. With a group of size 1 every operator is the identity (no call).
Activations are (B, T, C), sequence dim 1.
"""
from __future__ import annotations

import torch

from zerotron.distributed import comm


# ----------------------------------------------------------------------------- raw collectives
def _all_reduce(x, group, tag, op=comm.ReduceOp.SUM):
    if group.size() == 1:
        return x
    y = x.contiguous().clone()
    comm.all_reduce(y, op=op, group=group, tag=tag)
    return y


def _gather_dim(x, dim, group, tag):
    """Concatenate every rank's x along ``dim`` (rank order). Flat 1-D all-gather of the tensor
    with ``dim`` moved to the front (each rank's block is then one contiguous piece)."""
    n = group.size()
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty(n * moved.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(out, moved, group=group, tag=tag)
    return out.view(n * moved.size(0), *moved.shape[1:]).movedim(0, dim).contiguous()


def _reduce_scatter_dim(x, dim, group, tag):
    """Sum x over ranks and keep this rank's 1/n block along ``dim``."""
    n = group.size()
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.size(dim)} is not divisible by tp={n}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty(moved.size(0) // n, *moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, moved, group=group, tag=tag)
    return out.movedim(0, dim).contiguous()


def _split_dim(x, dim, group):
    n = group.size()
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"split along dim {dim}: size {x.size(dim)} is not divisible by tp={n}")
    return x.chunk(n, dim)[group.rank()].contiguous()


# ----------------------------------------------------------------------------- autograd operators
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.tag + "_bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        return _all_reduce(x, group, tag)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _GatherDim(torch.autograd.Function):
    """All-gather along ``dim``; backward: reduce-scatter if ``reduce_grad`` (sequence parallel:
    each rank's gradient is a partial sum) else split (the consumer is replicated)."""

    @staticmethod
    def forward(ctx, x, dim, group, tag, reduce_grad):
        ctx.dim, ctx.group, ctx.tag, ctx.reduce_grad = dim, group, tag, reduce_grad
        return _gather_dim(x, dim, group, tag)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return _reduce_scatter_dim(g, ctx.dim, ctx.group, ctx.tag + "_bwd"), None, None, None, None
        return _split_dim(g, ctx.dim, ctx.group), None, None, None, None


class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return _reduce_scatter_dim(x, dim, group, tag)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim(g, ctx.dim, ctx.group, ctx.tag + "_bwd"), None, None, None


class _SplitDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim(g, ctx.dim, ctx.group, ctx.tag + "_bwd"), None, None, None


def _eager_apply(op, *args):
    return op.apply(*args)


_apply = _eager_apply  # how the f/g operators below run their autograd Function (see opaque_to_compiler)


def opaque_to_compiler() -> None:
    """Make every f/g operator of this module a graph break under ``torch.compile`` (called once by
    ``parallel.compile`` for ``train.compile``): the operator runs eagerly with Dynamo off, so the
    collective and its byte accounting (``comm.STATS``, Python counters that change every call)
    are never traced -- traced, each call's new counter values failed a guard and recompiled."""
    global _apply
    _apply = torch.compiler.disable(_eager_apply, reason="tensor-parallel collective: a graph break by design")


def copy_to_tp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Megatron's f (Shoeybi et al. 2019, sec. 3): identity forward, all-reduce of the gradient in
    backward. Any shape; used before a column-parallel layer whose input is replicated."""
    return x if group.size() == 1 else _apply(_CopyToTP, x, group, tag)


def reduce_from_tp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Megatron's g (Shoeybi et al. 2019, sec. 3): all-reduce (sum) forward, identity backward.
    Any shape; used after a row-parallel layer (partial sums -> replicated output)."""
    return x if group.size() == 1 else _apply(_ReduceFromTP, x, group, tag)


def gather_from_sp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Sequence-parallel f (Korthikanti et al. 2022, sec. 4.2.2): (B, T/tp, C) -> (B, T, C) by
    all-gather along dim 1; backward reduce-scatters the gradient (B, T, C) -> (B, T/tp, C).
    Every rank must hold the same T/tp."""
    return x if group.size() == 1 else _apply(_GatherDim, x, 1, group, tag, True)


def reduce_scatter_to_sp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Sequence-parallel g (Korthikanti et al. 2022, sec. 4.2.2): partial sums (B, T, C) ->
    reduced shard (B, T/tp, C); backward all-gathers the gradient. Raises ValueError if T % tp."""
    return x if group.size() == 1 else _apply(_ReduceScatterDim, x, 1, group, tag)


def scatter_to_sp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Keep this rank's sequence shard of a replicated (B, T, C) tensor -> (B, T/tp, C) (no
    communication); backward all-gathers the gradient (Korthikanti et al. 2022). Raises ValueError
    if T is not divisible by tp."""
    return x if group.size() == 1 else _apply(_SplitDim, x, 1, group, tag)


def gather_from_tp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """All-gather along the last dim: (..., N/tp) -> (..., N) in rank order; backward keeps this
    rank's slice of the (replicated) gradient (Megatron's gather_output, Shoeybi et al. 2019).
    Every rank must hold the same N/tp (gloo cannot gather uneven sizes)."""
    return x if group.size() == 1 else _apply(_GatherDim, x, x.dim() - 1, group, tag, False)


def scatter_to_tp(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """This rank's slice of the last dim: (..., N) -> (..., N/tp); backward all-gathers (Megatron's
    scatter for a row-parallel layer whose input is replicated). Raises ValueError if tp does not
    divide N."""
    return x if group.size() == 1 else _apply(_SplitDim, x, x.dim() - 1, group, tag)
