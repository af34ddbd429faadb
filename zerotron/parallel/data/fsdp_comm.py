"""FSDP2's collectives counted by zerotron's accounting (``comm.STATS``).

torch FSDP2 (``fully_shard``) issues its all-gathers and reduce-scatters itself, so without help
they are missing from ``comm_bytes_by_op`` in metrics.jsonl and from ``zerotron dryrun``'s traced
traffic. FSDP2 lets a module replace the two primitives (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``, the ``AllGather`` / ``ReduceScatter`` interfaces of
``torch.distributed.fsdp``): :class:`CountedAllGather` and :class:`CountedReduceScatter` record
each call under the group's accounting name (:func:`zerotron.distributed.comm.count`, nccl-tests
sizes: the all-gather's output bytes, the reduce-scatter's input bytes) and then run exactly what
FSDP2's defaults run (``all_gather_single`` / ``reduce_scatter_single``, buffers from
``torch.empty``), returning the raw ``Work`` FSDP2 waits on. Not covered: HSDP's all-reduce of the
gradient shards across replicas (FSDP2 has no hook for it).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from zerotron.distributed import comm

__all__ = ["CountedAllGather", "CountedReduceScatter", "count_fsdp_collectives"]


def _empty(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(AllGather):
    """FSDP2's all-gather, counted as ``("all_gather", group.name, tag)``. ``group``: the
    ``comm.NamedGroup`` the module is sharded over (its name is the accounting label; FSDP2 passes
    the process group itself at each call)."""

    def __init__(self, group, tag: str = "fsdp2"):
        self.group, self.tag = group, tag

    def allocate(self, size, *, dtype, device):
        return _empty(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        comm.count("all_gather", self.group, output_tensor.numel() * output_tensor.element_size(), self.tag)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, counted as ``("reduce_scatter", group.name, tag)`` (see
    :class:`CountedAllGather`)."""

    def __init__(self, group, tag: str = "fsdp2"):
        self.group, self.tag = group, tag

    def allocate(self, size, *, dtype, device):
        return _empty(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        comm.count("reduce_scatter", self.group, input_tensor.numel() * input_tensor.element_size(), self.tag)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


def count_fsdp_collectives(modules, group) -> None:
    """Give every FSDP2 module of ``modules`` (``fully_shard``-ed) the counted primitives, labelled
    with ``group`` (a ``comm.NamedGroup``: the shard group)."""
    ag, rs = CountedAllGather(group), CountedReduceScatter(group)
    for m in modules:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
