"""Parallelism transforms. ``parallelize(model, cfg, mesh)`` applies them in one fixed order:

    1. pipeline split (parallel.pp)          -- not yet implemented
    2. tensor / sequence parallel (tp)       -- not yet implemented
    3. activation checkpointing              -- not yet implemented
    4. data parallel over "dp": native bucketed DDP or torch DDP

The returned *strategy* object is what the trainer drives. Its interface:
    strategy(idx) -> logits            forward
    strategy.module                    the underlying (plain) model
    strategy.parameters()              unique trainable parameters of this rank
    strategy.no_sync()                 context: accumulate without communicating
    strategy.finish_grads()            complete gradient reduction (after the last backward)
    strategy.zero_grad()
and the module-level :func:`clip_grad_norm` works on it.
"""
from __future__ import annotations

import torch

from .ddp import DataParallel, TorchDDP, unique_params


def parallelize(model, cfg, mesh):
    """Wrap ``model`` (already on ``mesh.device``, identically initialised on every rank) for the
    layout in ``cfg.parallel``. Raises ValueError for an unknown ``dp_impl``."""
    p = cfg.parallel
    group = mesh.group("dp")
    src = mesh.global_rank(mesh.coords["pp"], 0, mesh.coords["tp"])
    if p.dp_impl == "native":
        return DataParallel(model, group, bucket_mb=p.bucket_mb, src_rank=src)
    if p.dp_impl == "torch":
        return TorchDDP(model, group, bucket_mb=p.bucket_mb)
    raise ValueError(f"parallel.dp_impl must be 'native' or 'torch', got {p.dp_impl!r}")


def clip_grad_norm(strategy, max_norm: float) -> float:
    """Global L2 norm of all gradients (after reduction), clipping in place if ``max_norm > 0``.

    Replicated data parallelism: every rank holds the full reduced gradient, so the local norm *is*
    the global norm and is identical on every rank. Returns the norm before clipping (float)."""
    params = [q for q in strategy.parameters() if q.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(q.grad) for q in params]))
    return float(norm)


__all__ = ["parallelize", "clip_grad_norm", "DataParallel", "TorchDDP", "unique_params"]
