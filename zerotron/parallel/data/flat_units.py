"""The ZeRO flat buffers of a list of units: how parameters are grouped into buffers
(:func:`build_flats`) and the bytes the buffers hold (:func:`flat_state_bytes`). One buffer is a
:class:`~zerotron.parallel.data.flat_shard.FlatShard`; used by
:class:`~zerotron.parallel.data.zero.ZeroSync` and expert parallelism's accounting."""
from __future__ import annotations

import itertools
import os

import torch

from zerotron.parallel.data.flat_shard import FlatShard
from zerotron.parallel.tensor.layers import is_tp_sharded

__all__ = ["build_flats", "flat_state_bytes"]


def build_flats(units: list[list], names: dict, mask: dict, stage: int, group, compute_dtype, reduce_dtype,
                tied=None, offload: str = "none", group_of: dict | None = None,
                disk_dir: str | None = None) -> list[list[FlatShard]]:
    """The flat buffers of each unit (a list of Parameters): one per (trainable, weight-decay flag,
    tp-sharded, shard group) present, in that fixed order (trainable first, decay first, tp-sharded
    first, ``group`` first, then the other groups in the order their parameters appear), so
    tensor-parallel shards and tp-replicated parameters, frozen (LoRA base) and trainable parameters,
    and parameters sharded over different groups never share a buffer. ``names``: ``{id(param):
    FQN}``; ``mask``: ``{id(param): decay?}``; ``tied``: the Parameter marked ``is_tied`` (its unit
    should hold it alone); ``offload``: ``train.offload`` (see :class:`FlatShard`; ``optimizer-disk``
    maps ``disk_dir/flat-<pid>-<i>.bin`` for the i-th buffer: two runs sharing a folder never meet); ``group_of``: ``{id(param): group}`` for
    parameters sharded over another group than ``group`` (expert parameters over their
    expert-replica group, ``parallel.expert``). Each FlatShard gets ``tp_sharded`` and ``is_tied``.
    Collective-free."""
    group_of = group_of or {}
    out = []
    with torch.no_grad():
        for params in units:
            flats = []
            groups = [group] + list({id(g): g for g in (group_of[id(p)] for p in params if id(p) in group_of)
                                     if g is not group}.values())
            for train, decay, sharded in itertools.product((True, False), repeat=3):
                for g in groups:
                    ps = [p for p in params if p.requires_grad == train and mask.get(id(p), False) == decay
                          and is_tp_sharded(p) == sharded and group_of.get(id(p), group) is g]
                    if ps:
                        path = f"{disk_dir}/flat-{os.getpid()}-{sum(map(len, out)) + len(flats)}.bin" if disk_dir else None
                        f = FlatShard([names[id(p)] for p in ps], ps, decay, stage, g, compute_dtype,
                                      reduce_dtype, offload, path)
                        f.tp_sharded, f.is_tied = sharded, tied is not None and ps[0] is tied
                        flats.append(f)
            out.append(flats)
    return out


def flat_state_bytes(flats: list, optimizer) -> dict:
    """Bytes held now by ZeRO flat buffers ``flats``: parameters (compute copies; the fp32 master
    too when it is the parameter itself), gradients (full buffers of stage 1 or fp32 shards),
    optimizer (Adam state + fp32 master shards of mixed precision). Returns ``{"params_bytes",
    "grads_bytes", "optimizer_bytes", "total_bytes"}`` (ints, bytes, on the device); with
    ``train.offload = optimizer`` also ``host_bytes`` (master shards, their Adam state and the host
    gradient shards) and ``disk_bytes`` (0), and ``optimizer_bytes`` is 0; with ``optimizer-disk``
    the master shards and Adam state count as ``disk_bytes`` (the file's vectors, unpadded) and
    ``host_bytes`` holds only host gradient shards (none on a CPU-only machine). Offloaded, the host
    bytes are also split by part: ``host_params_bytes`` (``train.offload = params``: the host compute
    shards, the master when it is the compute shard), ``host_grads_bytes``, ``host_optimizer_bytes``
    (masters and Adam state); they sum to ``host_bytes``."""
    p = g = o = hp = hg = ho = d = 0
    for f in flats:
        p += f.full.untyped_storage().size()
        master = f.master.numel() * f.master.element_size()
        if f.params_offload and f.frozen:  # the compute-dtype master is the host shard
            hp += master
            continue
        if f.offload:
            p += f.dev_shard.numel() * f.dev_shard.element_size() if f.dev_shard is not None else 0
            g += 0 if f.grad_aliased else f.shard_grad.numel() * f.shard_grad.element_size()
            g += f.grad_full.numel() * f.grad_full.element_size() if f.grad_full is not None else 0
            hg += f.host_grad.numel() * f.host_grad.element_size() if f.host_grad is not None else 0
            if f.disk is not None:
                d += 3 * master
                continue
            if f.host_shard is not None:  # params offload: the master serves as the compute shard, or a copy
                hp += master if f.host_shard is f.master or f.host_shard.data_ptr() == f.master.data_ptr() \
                    else f.host_shard.numel() * f.host_shard.element_size()
            shares = f.host_shard is not None and f.host_shard.data_ptr() == f.master.data_ptr()
            ho += (0 if shares else master) + sum(t.numel() * t.element_size()
                                                  for t in optimizer.state.get(f.master, {}).values()
                                                  if isinstance(t, torch.Tensor) and t.dim() > 0)
            continue
        if f.stage == 3 and f.compute_dtype == f.master_dtype:
            p += master
        elif not f.aliased:
            o += master
        if f.grad_full is not None:
            g += f.grad_full.numel() * f.grad_full.element_size()
        if not (f.stage == 1 and f.aliased):
            g += f.shard_grad.numel() * f.shard_grad.element_size()
        for t in optimizer.state.get(f.master, {}).values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                o += t.numel() * t.element_size()
    out = {"params_bytes": p, "grads_bytes": g, "optimizer_bytes": o, "total_bytes": p + g + o}
    if any(f.offload or f.params_offload for f in flats):
        out.update(host_bytes=hp + hg + ho, disk_bytes=d, host_params_bytes=hp, host_grads_bytes=hg,
                   host_optimizer_bytes=ho)
    return out
