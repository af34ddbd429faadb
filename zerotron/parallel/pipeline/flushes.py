"""The step of a pipeline rank: its micro-batches in flushes, each walked along this rank's action
list of the schedule, and the forward-only pipeline of an evaluation batch. Mixed into
``pipeline.runner.PipelineStrategy``.

Schedules (``parallel.pp_schedule``, built by ``schedules.build_schedule`` and walked by
``pipeline.executor.PipelineExecutor``): "naive" (model parallel: each flush's micro-batches
concatenated into one batch, one stage busy at a time), "gpipe" (Huang et al. 2019), "1f1b"
(PipeDream-Flush, Narayanan et al. 2021), "interleaved" (Megatron-LM, Narayanan et al. 2021),
"zb-h1" (Qi et al. 2024, zero bubble: each backward split into B, the input gradient, and W, the
weight gradients, run later; ``pipeline.split_backward``), "zb-v" (Qi et al. 2024, ZB-V: the same split
backward over two model stages per rank placed in a V, rank r holding stages r and 2pp-1-r, so rank 0
has both the embedding and the head and the tied weight needs no cross-rank sum; gloo only). Gradient synchronisers see W as the
backward: DDP's last-flush buckets fire in the last micro-batch's W, ZeRO-2/3 reduce-scatter after
each W (ZeRO-3 gathers the stage's blocks for it: recomputation and saved tensors read them).

Step structure: the trainer hands this rank its M micro-batches; ``m = parallel.microbatches or M``
per pipeline flush, M/m flushes (outer gradient accumulation, no rescaling). Gradients are summed
over dp by an inner ``DataParallel`` whose hooks fire inside the pipeline backward, only in the last
flush (and only on each chunk's last backward); ``finish_grads`` waits for it and then sums the tied
embedding/head gradients between the first and last pipeline rank. With ``parallel.dp_impl = torch``
(``plan.sync == "torch_ddp"``) each local chunk gets its own torch DDP instead
(``pipeline.stage_sync.StageTorchDDP``: no_sync before, the reducer armed before the chunk's last backward);
with ``parallel.zero_impl = fsdp2`` (ZeRO-2/3) FSDP2 shards each local block and one root of the rank's
other modules over dp (``pipeline.stage_sync.StageFSDP2``: gradients accumulate unsharded over the step,
one reduce-scatter per unit after the last backward; the tied copies are sharded alike on the first and
last rank, so ``finish_grads`` sums their local shards over the tied group).
"""
from __future__ import annotations

import contextlib

import torch

from zerotron.parallel.base import IGNORE_INDEX, autocast_ctx
from zerotron.parallel.pipeline.executor import forward_only_actions
from zerotron.parallel.pipeline.schedules import build_schedule

__all__ = ["PipelineFlushMixin"]


class PipelineFlushMixin:
    """``forward_backward`` / ``eval_loss_sum`` / ``last_step_timing`` (and the gradient-accumulation
    ``no_sync`` / ``zero_grad``) for :class:`~zerotron.parallel.pipeline.runner.PipelineStrategy`;
    uses the attributes its constructor sets (``module``, ``executor``, ``inner``, ``zero``, ...)."""

    def _actions(self, m: int) -> list:
        """This rank's action list for a flush of ``m`` micro-batches (cached)."""
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.pp, m, self.kind, self.v)[self.rank]
        return self._schedules[m]

    # ---- training ----------------------------------------------------------------------------
    def no_sync(self):
        return self.inner.no_sync()

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        if self.ddp is not None and self.experts is not None:
            self.experts.zero_grads()

    def flush_size(self, M: int) -> int:
        """Micro-batches per pipeline flush for ``M`` micro-batches per step: parallel.microbatches,
        or M when that is 0. Raises ValueError if it does not divide M."""
        m = self.microbatches or M
        if M % m:
            raise ValueError(f"this rank has {M} micro-batches per step, not divisible by "
                             f"parallel.microbatches = {m}; choose a divisor of {M} (or 0 = all)")
        return m

    def forward_backward(self, micro_batches, n_global: int, dtype: str, device: torch.device) -> torch.Tensor:
        """Pipelined forward/backward over this rank's micro-batches ``[(x, y), ...]`` (each (b, T)
        int64, the same on every pp rank of a dp coordinate) in M/m flushes; each micro-batch's
        token-CE sum is divided by ``n_global``. Returns this rank's loss sum (float64 scalar, CPU;
        zero except on the last stage). Raises ValueError if M % m != 0 (m =
        parallel.microbatches or M) or the schedule rejects m (interleaved: m % pp != 0)."""
        M = len(micro_batches)
        m = self.flush_size(M)
        total = torch.zeros((), dtype=torch.float64)
        ex = self.executor
        ex.reset_timing()
        n_flush = M // m
        if self.zero is not None:
            self.zero.begin_step()
        if self.stage_sync is not None:  # FSDP2 averages over dp: the loss is pre-scaled
            self.stage_sync.begin_step()
            n_global = n_global / self.stage_sync.loss_scale
        try:
            self._flushes(micro_batches, m, n_flush, n_global, dtype, device, total)
        finally:
            if self.zero is not None:
                self.zero.end_step()
        if self.stage_sync is not None:
            self.stage_sync.end_step()
        wall = ex.busy_s + ex.idle_s
        per_stage = {}  # kind -> {model stage: mean seconds per micro-batch}
        for (kind, chunk), sec in ex.compute_s.items():
            per_stage.setdefault(kind, {})[self.module.stages[chunk]] = sec / ex.compute_n[(kind, chunk)]
        q = ex.p2p
        self._timing = {"busy_s": ex.busy_s, "idle_s": ex.idle_s,
                        "bubble_fraction": ex.idle_s / wall if wall > 0 else 0.0,
                        "post_s": q.post_s, "post_cpu_s": q.post_cpu_s, "recv_wait_s": q.recv_wait_s, "send_wait_s": q.send_wait_s,
                        "other_s": ex.other_s, "walk_start_s": ex.walk_start_s, "walk_end_s": ex.walk_end_s,
                        "p2p_events": list(q.events),
                        "stage_compute_s": per_stage, "schedule": (self.pp, m if self.kind != "naive" else 1,
                                                                   self.kind, self.v)}
        return total

    def _flushes(self, micro_batches, m, n_flush, n_global, dtype, device, total) -> None:
        """The M/m pipeline flushes of one step; adds each micro-batch's loss sum into ``total``."""
        ex = self.executor
        for f in range(n_flush):
            mbs = [(x.to(device), y.to(device)) for x, y in micro_batches[f * m:(f + 1) * m]]
            if self.kind == "naive":
                mbs = [(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs]))]
            sums = []

            def on_output(mb, logits):
                loss = self.loss_sum(logits, mbs[mb][1])
                sums.append(loss.detach())
                return loss / n_global

            final, k = f == n_flush - 1, len(mbs)
            # sync only in the final flush, on each chunk's last backward; if this rank holds the
            # first and the last stage (pp == 1, interleaved) the tied weight's last gradient comes
            # from chunk 0, so the last chunk's final backward must not mark it ready.
            late = self.first and self.last and self.v > 1

            def b_context(mb, chunk):
                if self.zero is not None:  # ZeRO-2/3: reduce-scatter what this backward produced
                    return self._after_backward(mb, chunk)
                if self.stage_sync is not None:  # torch DDP / FSDP2: each chunk its own unit
                    return self.stage_sync.backward_context(chunk, final and mb == k - 1)
                sync = final and mb == k - 1 and not (late and chunk == self.v - 1)
                return contextlib.nullcontext() if sync else self.inner.no_sync()

            w_context = (self._zero3_weight_pass if self.zero is not None and self.zero.stage == 3
                         else self.fsdp2.weight_context if self.fsdp2 is not None else None)
            ex.run(self._actions(k), [x for x, _ in mbs], on_output,
                   lambda: autocast_ctx(dtype, device), b_context, w_context, self.documents)
            for s in sums:
                total += s.double().cpu()

    @contextlib.contextmanager
    def _after_backward(self, mb, chunk):
        yield
        self.zero.after_backward(self._chunk_units[chunk])

    @contextlib.contextmanager
    def _zero3_weight_pass(self, mb, chunk):
        """ZeRO-3 around a W (split backward): the chunk's blocks gathered, then reduce-scatter and free."""
        self.zero.gather_blocks(self._chunk_units[chunk])
        yield
        self.zero.after_backward(self._chunk_units[chunk])

    def last_step_timing(self) -> dict:
        """This rank's pipeline timing of the last ``forward_backward``: ``busy_s`` (compute),
        ``idle_s`` (posting and waiting p2p runs, i.e. bubble + transfer), ``bubble_fraction`` =
        idle / (busy + idle); idle split into ``post_s`` (posting p2p ops; ``post_cpu_s`` of it
        on this thread's CPU, the rest descheduled), ``recv_wait_s`` (waiting
        for receives) and ``send_wait_s`` (waiting for sends at the end of each walk); ``other_s``:
        the walks' remaining wall time (executor bookkeeping, outside busy and idle);
        ``walk_start_s``/``walk_end_s``: ``time.perf_counter()`` at the first walk's start and the
        last one's end (comparable between ranks of one host: start skew); ``p2p_events``: per
        message timestamps (``pipeline.p2p``; :func:`zerotron.parallel.pipeline.accounting.
        recv_wait_split` splits receive waits into dependency and transfer); ``stage_compute_s`` =
        ``{kind: {model stage: mean seconds of one action}}`` for kind "F", "B" of this rank's
        stages (what :func:`zerotron.parallel.pipeline.accounting.predicted_bubble` simulates);
        ``schedule`` = (pp, micro-batches per flush, kind, v). Compare with
        ``simulation.bubble_theory``. Seconds throughout."""
        return dict(self._timing)

    # ---- evaluation --------------------------------------------------------------------------
    def _forward_only(self, x: torch.Tensor, on_output, dtype: str, device: torch.device) -> None:
        acts = forward_only_actions(self.placement, self.rank)
        self.executor.reset_timing()  # the last step's timing is already in _timing; bound the event list
        with self.zero.full_params(blocks=False) if self.zero is not None else contextlib.nullcontext():
            self.executor.run(acts, [x], on_output, lambda: autocast_ctx(dtype, device), documents=self.documents)
        if self.fsdp2 is not None:  # a gradient-free forward leaves units unsharded (zero_stage 2)
            self.fsdp2.reshard()

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor, dtype: str, device: torch.device):
        """Forward-only pipeline of one batch x, y (b, T): ``(loss_sum, valid_count)`` float64 CPU
        scalars on the last stage, zeros elsewhere (the caller sums over ``loss_groups``)."""
        x, y = x.to(device), y.to(device)
        out = [torch.zeros((), dtype=torch.float64)] * 2

        def on_output(mb, logits):
            out[0] = self.loss_sum(logits, y).double().cpu()
            out[1] = torch.tensor(float((y != IGNORE_INDEX).sum()), dtype=torch.float64)

        self._forward_only(x, on_output, dtype, device)
        return out[0], out[1]
