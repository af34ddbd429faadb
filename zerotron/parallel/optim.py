"""Optimizer construction that the strategies need: weight-decay masks and AdamW parameter groups.
Here (not in ``train``) so that ``parallel`` never imports ``train``; ``zerotron.train.optim``
re-exports these next to the learning-rate schedule."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["decay_mask", "decay_mask_by_name", "build_optimizer", "impl_kwargs", "IMPLS"]


def decay_mask(module: nn.Module) -> dict[int, bool]:
    """Map ``id(param) -> apply weight decay?``: True for weight matrices -- Linear weights and any
    other parameter of >= 2 dimensions (stacked MoE expert matrices) -- False for biases, norm
    parameters and embeddings (GPT-2/nanoGPT convention). Tied parameters count once (the
    embedding wins, so the tied LM head is not decayed)."""
    mask: dict[int, bool] = {}
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in mask and not mask[id(p)]:
                continue
            linear = isinstance(mod, nn.Linear) and name == "weight"
            mask[id(p)] = (linear or (not isinstance(mod, nn.Linear) and p.dim() >= 2)) and not isinstance(mod, nn.Embedding)
    for mod in module.modules():  # embeddings override (tied LM head shares the embedding weight)
        if isinstance(mod, nn.Embedding):
            mask[id(mod.weight)] = False
    return mask


def decay_mask_by_name(module: nn.Module) -> dict[str, bool]:
    """:func:`decay_mask` keyed by parameter FQN (every name of a tied parameter), so it survives
    transforms that replace parameter objects (tensor parallelism slices them)."""
    mask = decay_mask(module)
    return {n: mask[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}


IMPLS = ("fused", "foreach", "loop")


def impl_kwargs(impl: str) -> dict:
    """``torch.optim.AdamW`` keyword arguments of ``train.optimizer_impl``: "fused" (one fused
    kernel over all tensors of a group: ``fused=True``), "foreach" (torch's multi-tensor
    ``_foreach_*`` ops) or "loop" (torch's single-tensor path, one parameter after the other: what
    torch picks by itself for CPU tensors). The three compute the same update (Loshchilov & Hutter
    2019, decoupled weight decay) and differ in rounding by at most about 1 ulp (measured). Raises
    ValueError for another name."""
    if impl not in IMPLS:
        raise ValueError(f"train.optimizer_impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def build_optimizer(params: list[nn.Parameter], mask: dict[int, bool], tcfg) -> torch.optim.AdamW:
    """AdamW over ``params`` with two groups: decayed (``mask[id(p)]``) and not decayed.

    ``tcfg``: TrainConfig (lr, beta1, beta2, eps, weight_decay, optimizer_impl: see
    :func:`impl_kwargs`; the parity reference and every layout read the same field, so they step
    with the same kernel). Group order is fixed (decay first)
    so optimizer state dicts line up across layouts. An empty group is left out (LoRA trains only
    2-D adapters: no group without decay), since torch.distributed.checkpoint matches groups by
    their parameters' names and cannot restore one without any."""
    decay = [p for p in params if mask.get(id(p), False)]
    no_decay = [p for p in params if not mask.get(id(p), False)]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]] or groups
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                             **impl_kwargs(getattr(tcfg, "optimizer_impl", "fused")))
