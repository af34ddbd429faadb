"""AdamW with weight-decay masks, and the warmup + cosine learning-rate schedule. The masks and
the optimizer builder live in ``zerotron.parallel.optim`` (the strategies build their optimizers);
they are re-exported here."""
from __future__ import annotations

import math

import torch

from ..parallel.optim import build_optimizer, decay_mask, decay_mask_by_name

__all__ = ["decay_mask", "decay_mask_by_name", "build_optimizer", "lr_at", "build_scheduler"]


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
