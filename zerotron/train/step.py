"""One optimizer step and evaluation, driven through the strategy interface (parallel.base).

Loss normalisation (world-size invariance): see ``parallel.base``; N_global is the number of valid
target tokens of the whole global batch, counted locally and all-reduced over the dp group.
"""
from __future__ import annotations

import torch

from ..distributed import comm
from ..parallel.base import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "train_step", "evaluate", "global_token_count"]


def global_token_count(micro_batches, group) -> int:
    """Valid target tokens in the global batch: this rank's count all-reduced over ``group`` (dp)."""
    local = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
    t = torch.tensor([local], dtype=torch.float64)
    comm.all_reduce(t, group=group, tag="loss_norm")
    return int(t.item())


def train_step(strategy, optimizer, scheduler, micro_batches, group, grad_clip: float = 0.0,
               dtype: str = "fp32", device: torch.device | None = None, guard=None) -> dict:
    """Forward/backward over this rank's ``micro_batches`` (list of ``(x, y)``, each (b, T) int64),
    gradient sync once per step, clipping, optimizer and LR-scheduler step.

    ``group``: the batch group (``Mesh.group("batch")``, dp x cp: the target-token count). ``guard``: a ``lifecycle.StepGuard`` or None; with one,
    all ranks agree (one small all-reduce) whether the loss and grad norm are finite, and a
    non-finite step applies no update and does not advance the LR schedule. Returns ``{"loss":
    global mean loss, "grad_norm", "tokens": N_global, "lr": lr used, "skipped": bool}``. Raises
    ValueError if the global batch has no valid target."""
    device = device or torch.device("cpu")
    n_global = global_token_count(micro_batches, group)
    if n_global == 0:
        raise ValueError("the global batch has no valid target token (all targets are ignore_index)")
    strategy.zero_grad()
    loss_sum = strategy.forward_backward(micro_batches, n_global, dtype, device)
    strategy.finish_grads()
    if guard is not None:
        guard.before_clip(strategy)
    grad_norm = strategy.clip_grad_norm(grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    loss = strategy.reduce_loss(loss_sum) / n_global
    skipped = guard is not None and guard.decide(loss, grad_norm)
    if not skipped:
        strategy.optimizer_step(optimizer)
        scheduler.step()
    return {"loss": loss, "grad_norm": grad_norm, "tokens": n_global, "lr": lr, "skipped": skipped}


@torch.no_grad()
def evaluate(strategy, batches, dtype: str = "fp32", device: torch.device | None = None) -> float:
    """Mean validation loss over all ranks' ``batches`` (list of ``(x, y)``, each (b, T) int64): loss
    sums and token counts are all-reduced over the strategy's loss groups, so the value does not
    depend on dp. Every dp rank must pass the same number of batches (sharded strategies gather
    parameters collectively in each forward); pad with batches whose targets are all
    ``IGNORE_INDEX`` (see ``train.setup.val_rank_windows``). Returns NaN if no target is valid."""
    device = device or torch.device("cpu")
    model = strategy.module
    was_training = model.training
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64)
    for x, y in batches:
        loss_sum, count = strategy.eval_loss_sum(x, y, dtype, device)
        acc[0] += loss_sum
        acc[1] += count
    for g in strategy.loss_groups:
        comm.all_reduce(acc, group=g, tag="metrics")
    model.train(was_training)
    return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")
