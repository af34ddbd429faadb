"""AdamW with weight-decay masks, and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch
import torch.nn as nn


def decay_mask(module: nn.Module) -> dict[int, bool]:
    """Map ``id(param) -> apply weight decay?``: True for weight matrices of Linear layers only;
    False for biases, LayerNorm parameters and embeddings (GPT-2/nanoGPT convention).
    Tied parameters count once (the embedding wins, so the tied LM head is not decayed)."""
    mask: dict[int, bool] = {}
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in mask and not mask[id(p)]:
                continue
            mask[id(p)] = isinstance(mod, nn.Linear) and name == "weight" and not isinstance(mod, nn.Embedding)
    for mod in module.modules():  # embeddings override (tied LM head shares the embedding weight)
        if isinstance(mod, nn.Embedding):
            mask[id(mod.weight)] = False
    return mask


def decay_mask_by_name(module: nn.Module) -> dict[str, bool]:
    """:func:`decay_mask` keyed by parameter FQN (every name of a tied parameter), so it survives
    transforms that replace parameter objects (tensor parallelism slices them)."""
    mask = decay_mask(module)
    return {n: mask[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}


def build_optimizer(params: list[nn.Parameter], mask: dict[int, bool], tcfg) -> torch.optim.AdamW:
    """AdamW over ``params`` with two groups: decayed (``mask[id(p)]``) and not decayed.

    ``tcfg``: TrainConfig (lr, beta1, beta2, eps, weight_decay). Group order is fixed (decay first)
    so optimizer state dicts line up across layouts."""
    decay = [p for p in params if mask.get(id(p), False)]
    no_decay = [p for p in params if not mask.get(id(p), False)]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps)


def lr_at(step: int, tcfg) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps`` steps ((step+1)/warmup), then cosine decay to ``min_lr`` at ``steps``:
    min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * progress)), progress = (step - warmup)/(steps - warmup).
    (Loshchilov & Hutter 2017, SGDR; the GPT-2/nanoGPT recipe.)"""
    if step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    return tcfg.min_lr + (tcfg.lr - tcfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, tcfg) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose factor at scheduler step k is ``lr_at(k) / lr``; step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_at(k, tcfg) / tcfg.lr)
