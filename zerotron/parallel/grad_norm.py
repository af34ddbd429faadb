"""The one global gradient-norm and clipping rule every strategy uses.

A strategy describes where its gradient elements live; this module sums their squares so that every
element of the model is counted exactly once, whatever the layout:

  * a *part* is a list of local gradient tensors and the groups whose ranks hold *different*
    elements of it (tensor-parallel shards: the tp group; ZeRO/FSDP2 shards: the dp group); its sum
    of squares is all-reduced over those groups;
  * the parts' sums are added, then all-reduced over ``outer`` groups whose ranks hold different
    parts of the model (pipeline stages: the pp group; ZeRO shards of every part: the dp group);
  * anything identical on several ranks (dp replicas after an all-reduce, tp-replicated norms and
    biases) is in a part whose groups leave those ranks out, so it counts once.

Squares are accumulated in float64 on every layout (the same arithmetic on one process and on
many); the norm is then taken in the gradients' dtype and the clip coefficient follows torch's
``clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``, applied in place when
``max_norm > 0`` (Pascanu et al. 2013, gradient clipping by norm; as Megatron-LM's ``clip_grads``,
which reduces the squared norm over the model-parallel group).
"""
from __future__ import annotations

import torch

from zerotron.distributed import comm

__all__ = ["clip_grad_norm"]


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g  # a DTensor gradient: this rank's shard


def clip_grad_norm(parts: list, max_norm: float, outer=(), also_clip=()) -> float:
    """Global L2 norm of the gradients described by ``parts``; clip them (and ``also_clip``) in place.

    ``parts``: ``[(grads, groups), ...]``, ``grads`` a list of gradient tensors (DTensors: their local
    shards are used), ``groups`` the ``comm.NamedGroup``s to sum that part's squares over (None or
    size-1 groups are skipped). ``outer``: groups to sum the total over. ``also_clip``: gradients
    scaled by the same coefficient but not counted (e.g. a tied copy counted on another rank).
    Collective over every group given, in a fixed order (tag "grad_norm"); identical result on
    every rank of them. Returns the norm before clipping (a float)."""
    grads = [_local(g) for gs, _ in parts for g in gs]
    extra = [_local(g) for g in also_clip]
    ref = (grads + extra)[0] if grads or extra else torch.zeros(())
    dev = ref.device
    total = torch.zeros(1, dtype=torch.float64, device=dev)
    for gs, groups in parts:
        local = [_local(g) for g in gs]
        sq = torch.zeros(1, dtype=torch.float64, device=dev)
        if local:
            sq += torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64)).square().sum()
        for group in groups:
            if group is not None and group.size() > 1:
                comm.all_reduce(sq, group=group, tag="grad_norm")
        total += sq
    for group in outer:
        if group is not None and group.size() > 1:
            comm.all_reduce(total, group=group, tag="grad_norm")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads + extra) else torch.float32
    norm = total[0].sqrt().to(dtype)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads + extra:
            g.mul_(coef.to(g.dtype))
    return float(norm)
