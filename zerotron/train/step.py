"""One optimizer step: micro-batch loop, loss normalisation, gradient sync, clipping, update.

Loss normalisation (world-size invariance): every micro-batch contributes
    sum of its token cross-entropies / N_global
where N_global is the number of valid target tokens (``!= ignore_index``) in the *whole global batch*
across all dp ranks and micro-batches. Gradients are then SUMMED over dp ranks. The result equals the
single-process mean over all valid tokens, whatever the split into ranks and micro-batches.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..parallel import clip_grad_norm

IGNORE_INDEX = -100


def autocast_ctx(dtype: str, device: torch.device):
    """``torch.autocast`` to bfloat16 for ``dtype == "bf16"``, else a null context (fp32)."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over valid targets: logits (B, T, V), targets (B, T) int64 -> scalar fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def global_token_count(micro_batches, group) -> int:
    """Valid target tokens in the global batch: local count all-reduced over the dp group."""
    local = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
    t = torch.tensor([local], dtype=torch.float64)
    comm.all_reduce(t, group=group, tag="loss_norm")
    return int(t.item())


def train_step(strategy, optimizer, scheduler, micro_batches, group, grad_clip: float = 0.0,
               dtype: str = "fp32", device: torch.device | None = None) -> dict:
    """Run forward/backward on ``micro_batches`` (this rank's list of ``(x, y)``, each (b, T) int64),
    synchronise gradients once, clip, and step the optimizer and LR scheduler.

    Communication: no gradient traffic on micro-batches but the last (``strategy.no_sync()``); one
    bucketed all-reduce pass overlapped with the last backward. Returns
    ``{"loss": global mean loss (float), "grad_norm": float, "tokens": N_global, "lr": lr used}``.
    Raises ValueError if the global batch has no valid target token."""
    device = device or torch.device("cpu")
    n_global = global_token_count(micro_batches, group)
    if n_global == 0:
        raise ValueError("the global batch has no valid target token (all targets are ignore_index)")
    strategy.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float64)
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        ctx = strategy.no_sync() if i < last else contextlib.nullcontext()
        with ctx:
            with autocast_ctx(dtype, device):
                logits = strategy(x)
            loss = token_loss_sum(logits, y)
            (loss / n_global).backward()
        loss_sum += loss.detach().double().cpu()
    strategy.finish_grads()
    grad_norm = clip_grad_norm(strategy, grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    comm.all_reduce(loss_sum, group=group, tag="metrics")
    return {"loss": float(loss_sum) / n_global, "grad_norm": grad_norm, "tokens": n_global, "lr": lr}


@torch.no_grad()
def evaluate(model, batches, group, dtype: str = "fp32", device: torch.device | None = None) -> float:
    """Mean validation loss over all ranks' ``batches`` (list of ``(x, y)``): sums of token losses and
    token counts are all-reduced over ``group``, so the value does not depend on the dp degree."""
    device = device or torch.device("cpu")
    was_training = model.training
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast_ctx(dtype, device):
            logits = model(x)
        acc[0] += token_loss_sum(logits, y).double().cpu()
        acc[1] += int((y != IGNORE_INDEX).sum())
    comm.all_reduce(acc, group=group, tag="metrics")
    model.train(was_training)
    return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")
