"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685; ``zerotron.models.lora``) on
tensor-parallel projections: each adapter is split to match its base layer, and its rank-r
intermediate crosses the tp boundary through the same conjugate operators as the base layer
(Shoeybi et al. 2019, sec. 3; with sequence parallelism Korthikanti et al. 2022, sec. 4.2.2).

  column-parallel base (weight rows split, output (B, T, out/tp)): A (r, in) replicated, B (out, r)
      split by its rows exactly as the base weight (the same ``chunks``, e.g. a fused [q|k|v]), so
      rank t's B_t B-rows match its output columns. h = x Aᵀ runs in the replicated region (on the
      sequence shard under SP), then enters the tp region through f (copy to tp; all-gather along
      the sequence under SP) and y_t += s · h B_tᵀ.
  row-parallel base (weight input columns split, input (B, T, in/tp)): A (r, in) split by its
      columns like the base weight, B (out, r) replicated. h_t = x_t A_tᵀ is a partial sum, reduced
      by g (all-reduce; reduce-scatter along the sequence under SP), then y += s · h Bᵀ in the
      replicated region.

So the replicated adapter half (A of a column, B of a row projection) lives in the replicated region
and its gradient is that of any tp-replicated parameter: equal on every tp rank without SP, summed
over tp with SP (``transform.sync_replicated_grads``, ZeRO's tp sums), counted once in the norm.
The r-dim reduction is a separate collective (tag ``tp_lora``) rather than part of the base's: added
into the base partial sums, B's gradient would be a partial sum on every rank even without SP. Its
size is r / out of the base's. ``W_t + s B_t A`` (column) and ``W_t + s B A_t`` (row) are exactly
this rank's shard of the merged weight, so ``models.lora.merge_lora`` works on the shards.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from zerotron.parallel.tensor.layers import (
    MODEL_PARALLEL,
    REPLICATED,
    copy_to_tp,
    gather_from_sp,
    mark_sharded,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
    shard_tensor,
)

__all__ = ["shard_adapter"]

_TAG = "tp_lora"


def _dropout(m, x, sharded: bool):
    """``lora_dropout`` on the adapter input, masks from the tp RNG tracker: "model-parallel" for a
    tp- or sequence-sharded input, "replicated" for a replicated one (the same mask on every tp rank)."""
    if m.lora_dropout <= 0 or not m.training:
        return x
    with m.lora_tracker.fork(MODEL_PARALLEL if sharded else REPLICATED):
        return F.dropout(x, m.lora_dropout, True)


def _column_hook(m, inputs, out):
    g, sp = m.tp_group, m.sequence_parallel
    h = F.linear(_dropout(m, inputs[0], sp), m.lora_A)  # (B, T, r), or (B, T/tp, r) under SP
    h = gather_from_sp(h, g, _TAG) if sp else copy_to_tp(h, g, _TAG)
    return out + F.linear(h, m.lora_B) * m.lora_scaling  # (B, T, out/tp)


def _row_hook(m, inputs, out):
    g, x = m.tp_group, inputs[0]
    if not m.input_is_parallel:
        x = scatter_to_tp(x, g, _TAG)
    h = F.linear(_dropout(m, x, True), m.lora_A)  # partial (B, T, r)
    h = reduce_scatter_to_sp(h, g, _TAG) if m.sequence_parallel else reduce_from_tp(h, g, _TAG)
    return out + F.linear(h, m.lora_B) * m.lora_scaling


def shard_adapter(dense: nn.Linear, layer: nn.Module, style: str, chunks: int, tp_group, tracker) -> None:
    """Move the adapter of the dense projection ``dense`` (``lora_A`` (r, in), ``lora_B`` (out, r),
    ``lora_scaling``, ``lora_dropout``; see ``models.lora.apply_lora``) onto its tensor-parallel
    replacement ``layer`` (``style`` "column" with ``chunks`` stacked output parts, or "row"), this
    rank's slices as in the module docstring, the sharded half marked with its ``TPShard``; installs
    the tp forward hook as ``layer.lora_handle``. ``tracker``: the model's ``RNGStatesTracker``
    (dropout masks). No-op when ``dense`` has no adapter. Raises ValueError for an unknown style or
    a split tp does not divide."""
    if not hasattr(dense, "lora_A"):
        return
    A, B = dense.lora_A.detach(), dense.lora_B.detach()
    if style == "column":
        a = nn.Parameter(A.clone())
        b = mark_sharded(nn.Parameter(shard_tensor(B, 0, tp_group, chunks)), 0, chunks)
        hook = _column_hook
    elif style == "row":
        a = mark_sharded(nn.Parameter(shard_tensor(A, 1, tp_group)), 1)
        b = nn.Parameter(B.clone())
        hook = _row_hook
    else:
        raise ValueError(f"shard_adapter: style must be 'column' or 'row', got {style!r}")
    layer.lora_A, layer.lora_B = a, b
    layer.lora_scaling, layer.lora_dropout, layer.lora_tracker = dense.lora_scaling, dense.lora_dropout, tracker
    dense.lora_handle.remove()
    layer.lora_handle = layer.register_forward_hook(hook)
