"""The torch.distributed.pipelining comparison backend (``parallel.pp_impl = "torch"``).

The same stage split, tied weights, dp gradient sync, gradient norm and checkpoints as the native
pipeline (:class:`~zerotron.parallel.pipeline.runner.PipelineStrategy`, whose construction this
reuses: ``parallel.pp_split`` incl. "auto", model stage ``c*pp + r`` on pipeline rank r), but each
flush is run by one of torch's schedules (``torch.distributed.pipelining.schedules``, torch 2.13)
over ``torch.distributed.pipelining.PipelineStage`` wrappers of this rank's model stages:

  ========================  ==========================================  ===========================
  ``parallel.pp_schedule``  torch schedule                              source
  ========================  ==========================================  ===========================
  gpipe                     ``ScheduleGPipe``                           Huang et al. 2019
  1f1b                      ``Schedule1F1B`` (needs m >= pp)            Narayanan et al. 2021
  interleaved               ``ScheduleInterleaved1F1B`` (v stages/rank) Narayanan et al. 2021
  zb-h1                     ``ScheduleInterleavedZeroBubble`` (v >= 1)  Qi et al. 2024 (ZB, looped)
  ========================  ==========================================  ===========================

``ScheduleInterleavedZeroBubble`` places model stages round-robin like Megatron interleaving (rank r
holds r, r + pp, ...), so it runs on the native split; ``ScheduleZBVZeroBubble`` (V placement: rank 0
holds stages 0 and 2pp-1) does not match the split and is not used.

Loss: torch calls ``loss_fn(logits (b, T, V), targets (b, T))`` once per micro-batch on the last
stage; it returns the token-CE sum divided by the global number of target tokens ``n_global``
(``scale_grads=False``: torch does not divide by the micro-batch count), exactly the native
normalisation, so the result is world-size-invariant. torch's first ``step`` runs a shape-inference
forward through the stages (on uninitialised inputs) that also calls ``loss_fn``; that value is
dropped (only the last m loss sums of a flush are counted) and never back-propagated. A flush's micro-batches are concatenated and
torch's ``step`` chunks them again along dim 0 (equal sizes: ``train.micro_batch`` each).

Gradients: every flush runs under the inner ``DataParallel.no_sync`` (torch's zero-bubble weight
pass accumulates into ``.grad`` itself, past the post-accumulate hooks), then the parameters that
got a gradient are marked used and ``finish_grads`` all-reduces the buckets over dp and sums the
tied embedding/head gradient between the end stages (group "pp_tied"), like the native pipeline.

Refused by config validation (one line each): pp < 2, tensor parallelism, ZeRO/FSDP2, torch DDP,
the "naive" schedule, 1f1b with fewer micro-batches per flush than pp.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from zerotron.models.layout import get_module, untracked_statistics
from zerotron.parallel.base import autocast_ctx
from zerotron.parallel.pipeline.runner import PipelineStrategy

__all__ = ["TORCH_SCHEDULES", "TorchPipeline"]

# parallel.pp_schedule -> (torch schedule class, takes a list of local stages)
TORCH_SCHEDULES = {"gpipe": (ScheduleGPipe, False), "1f1b": (Schedule1F1B, False),
                   "interleaved": (ScheduleInterleaved1F1B, True), "zb-h1": (ScheduleInterleavedZeroBubble, True)}


class _Chunk(nn.Module):
    """One model stage of a ``StageModel`` as a module of its own: registers exactly the modules the
    stage runs (layout embedding on stage 0, its blocks, layout head on the last stage; shared with
    the StageModel, no copies), so ``parameters()`` are the stage's (torch's weight pass needs them);
    ``forward(x)`` = ``StageModel.run_chunk(chunk, x)``: tokens (b, T) int64 or activations (b, T, C)
    -> activations (b, T, C) or logits (b, T, V)."""

    def __init__(self, stage_model, chunk: int, dtype: str, device: torch.device):
        super().__init__()
        lay, s = stage_model.layout(), stage_model.stages[chunk]
        names = (list(lay.embedding) if s == 0 else []) + [f"{lay.blocks}.{i}" for i in stage_model.layer_ranges[s]]
        if s == stage_model.last_stage:
            names += list(lay.head)
        self.parts = nn.ModuleList([get_module(stage_model, n) for n in names])
        object.__setattr__(self, "_stage_model", stage_model)
        self.chunk, self.dtype, self.device = chunk, dtype, device
        self.probed = False  # torch's shape inference (the first call) has run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast_ctx(self.dtype, self.device):
            if self.probed:
                return self._stage_model.run_chunk(self.chunk, x)
            # the first call is torch's shape inference on the first step, not a micro-batch: the
            # token statistics of the step (MoE router stats) must not count it
            self.probed = True
            with untracked_statistics(self):
                return self._stage_model.run_chunk(self.chunk, x)


class TorchPipeline(PipelineStrategy):
    """``PipelineStrategy`` whose flushes run torch's pipelining schedules (module docstring).

    Args as ``PipelineStrategy`` (a plan with ``pp_impl = "torch"``, which the plan allows only
    for schedules with a torch counterpart, native DDP and tp 1)."""

    def __init__(self, model, mesh, plan, mask: dict | None = None):
        super().__init__(model, mesh, plan, mask)
        self._torch_schedules: dict = {}

    def _torch_schedule(self, m: int, n_global: int, dtype: str, device: torch.device, sums: list):
        """torch schedule for flushes of ``m`` micro-batches (stages built once per (m, dtype))."""
        key = (m, dtype, str(device))
        if key not in self._torch_schedules:
            n_stages = self.pp * self.v
            stages = [PipelineStage(_Chunk(self.module, c, dtype, device), s, n_stages, device,
                                    group=self.pp_group.pg)
                      for c, s in enumerate(self.module.stages)]
            state = {}

            def loss_fn(logits, y):
                loss = self.loss_sum(logits, y)
                state["sums"].append(loss.detach())
                return loss / state["n_global"]

            cls, multi = TORCH_SCHEDULES[self.kind]
            sched = cls(stages if multi else stages[0], m, loss_fn=loss_fn, scale_grads=False)
            self._torch_schedules[key] = (sched, state)
        sched, state = self._torch_schedules[key]
        state["sums"], state["n_global"] = sums, n_global
        return sched

    def forward_backward(self, micro_batches, n_global: int, dtype: str, device: torch.device) -> torch.Tensor:
        """As ``PipelineStrategy.forward_backward`` (same arguments, return value and errors), each
        flush driven by the torch schedule."""
        M = len(micro_batches)
        m = self.flush_size(M)
        total = torch.zeros((), dtype=torch.float64)
        t0 = time.perf_counter()
        with self.ddp.no_sync():
            for f in range(M // m):
                mbs = micro_batches[f * m:(f + 1) * m]
                x = torch.cat([a for a, _ in mbs]).to(device)
                y = torch.cat([b for _, b in mbs]).to(device)
                sums: list = []
                sched = self._torch_schedule(m, n_global, dtype, device, sums)
                if self.first:
                    sched.step(x, target=y if self.last else None)
                else:
                    sched.step(target=y if self.last else None)
                for s in sums[len(sums) - m:]:  # the first step's shape inference adds one call
                    total += s.double().cpu()
        self.ddp.mark_used([q for q in self.ddp.module.parameters() if q.grad is not None])
        wall = time.perf_counter() - t0
        # torch's schedules expose no per-action times: busy = wall, the bubble is not measured (NaN)
        self._timing = {"busy_s": wall, "idle_s": 0.0, "bubble_fraction": float("nan"), "stage_compute_s": {},
                        "schedule": (self.pp, m, self.kind, self.v)}
        return total
