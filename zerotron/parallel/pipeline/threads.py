"""The in-process pipeline executor (``parallel.pp_impl = "threads"``): torchgpipe's design on CPU.

One process holds every model stage (``parallel.virtual_stages`` = n of them, split like the
multi-process pipeline: ``parallel.pp_split``); one worker thread per stage, fed through its own
task queue; a scheduler (the calling thread) walks GPipe's clock cycles (Huang et al. 2019; the
torchgpipe implementation, Kim et al. 2020, "torchgpipe: On-the-fly Pipeline Parallelism for
Training Giant Models", sec. 3.2): at forward clock k, stage j runs micro-batch i = k - j; at
backward clock k, stage j runs the backward of micro-batch i = k - (n - 1 - j); every task of a
clock is handed to its worker at once and the clock ends when all of them are done. Micro-batches
move between stages as tensors handed over in memory (the stage input is a detached leaf, like the
received activation of the multi-process executor), so there is no p2p communication; torch ops
release the GIL, so stages run in parallel on separate cores while their Python code interleaves.

Gradients: the model is the dense model, so checkpoints, the optimizer and the gradient norm are
those of one process (``DataParallel`` over the dp group: buckets only mark gradients as used
while the worker threads run, and ``finish_grads`` all-reduces them afterwards). A tied weight
(embedding and head on different stages) is one Parameter; autograd serialises its accumulation
(AccumulateGrad holds a lock), so the sum is right but the order of its two parts can vary from run
to run (fp64 parity holds; bitwise repeatability of that one gradient does not).

Refused by config validation (one line each): pp > 1 processes, tensor parallelism, ZeRO/FSDP2,
torch DDP, a schedule other than gpipe.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch

from zerotron.parallel.base import autocast_ctx
from zerotron.parallel.data.ddp import DataParallel
from zerotron.parallel.pipeline.balance import announce_split, resolve_split
from zerotron.parallel.pipeline.executor import StageModel, stage_layer_ranges

__all__ = ["ThreadedPipeline"]


class _Worker:
    """A daemon thread running the callables put on its queue; ``done`` receives (result, error)."""

    def __init__(self, name: str):
        self.tasks: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn = self.tasks.get()
            if fn is None:
                return
            try:
                out = (fn(), None)
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler, which re-raises
                out = (None, e)
            # the idle thread keeps no reference to the task: its closure holds the pipeline (stages,
            # gradient hooks, process groups), which would then never become garbage, so __del__ would
            # never stop this thread (one leaked pipeline, with its groups' threads, per Trainer)
            del fn
            self.done.put(out)
            del out

    def stop(self) -> None:
        self.tasks.put(None)


class ThreadedPipeline(DataParallel):
    """GPipe over ``n_stages`` worker threads of this process (see the module docstring).

    Args: ``model`` (a plain ``CausalLM``, identical on the dp ranks), ``mesh`` (its dp group syncs
    gradients; pp and tp must be 1), ``plan`` (a ``zerotron.plan.ParallelPlan`` with pp_impl =
    threads: ``virtual_stages`` = n_stages >= 2, ``pp_split``, ``microbatches``, ``bucket_mb``;
    ``activation_checkpointing`` for the cost estimate). Attributes: ``module`` (the dense model), ``stages`` (one ``StageModel`` per stage,
    sharing its modules), ``split`` (layers per stage). Raises ValueError for a split the model
    cannot take."""

    def __init__(self, model, mesh, plan):
        p = self.plan = plan
        n = p.virtual_stages
        super().__init__(model, mesh.group("dp"), bucket_mb=p.bucket_mb,
                         src_rank=mesh.peer(dp=0))
        recompute = p.activation_checkpointing
        self.split = resolve_split(model, n, p.pp_split, recompute)
        if mesh.rank == 0 and p.pp_split.strip() == "auto":
            announce_split(model, self.split, p.pp_split, recompute)
        ranges = stage_layer_ranges(self.split)
        self.n_stages, self.microbatches = n, p.microbatches
        self.stages = [StageModel(model, [s], ranges) for s in range(n)]
        self._workers = [_Worker(f"zerotron-stage-{s}") for s in range(n)]
        self._timing = {"busy_s": 0.0, "idle_s": 0.0, "bubble_fraction": 0.0}

    def close(self) -> None:
        """Stop the worker threads (they are daemons: also gone at interpreter exit)."""
        for w in self._workers:
            w.stop()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def _clock(self, tasks: dict) -> None:
        """Run ``{stage: callable}`` on the stages' workers at once; wait for all; re-raise the
        first error (after every task of the clock has finished)."""
        for s, fn in tasks.items():
            self._workers[s].tasks.put(fn)
        errors = [e for s in tasks for _, e in [self._workers[s].done.get()] if e is not None]
        if errors:
            raise errors[0]

    def forward_backward(self, micro_batches, n_global: int, dtype: str, device: torch.device) -> torch.Tensor:
        """GPipe over this rank's micro-batches ``[(x, y), ...]`` (each (b, T) int64) in M/m
        flushes (m = parallel.microbatches or M); each micro-batch's token-CE sum is divided by
        ``n_global``. Returns the loss sum (float64 scalar, CPU). Raises ValueError if M % m."""
        M = len(micro_batches)
        m = self.microbatches or M
        if M % m:
            raise ValueError(f"this rank has {M} micro-batches per step, not divisible by "
                             f"parallel.microbatches = {m}; choose a divisor of {M} (or 0 = all)")
        n, total = self.n_stages, torch.zeros((), dtype=torch.float64)
        busy, walk, ends = [0.0] * n, [0.0] * n, [0.0] * n
        times: dict = {}  # (kind, stage) -> [seconds, count]
        with self.no_sync():  # gradients only marked as used; finish_grads all-reduces them
            for f in range(M // m):
                mbs = [(x.to(device), y.to(device)) for x, y in micro_batches[f * m:(f + 1) * m]]
                t0 = time.perf_counter()
                total += self._flush(mbs, n_global, dtype, device, busy, times, ends)
                walk = [w + e - t0 for w, e in zip(walk, ends)]  # each stage: flush start -> its last task
        idle = [w - b for w, b in zip(walk, busy)]
        self._timing = {"busy_s": sum(busy), "idle_s": sum(idle),
                        "bubble_fraction": max(i / w for i, w in zip(idle, walk)) if min(walk) > 0 else 0.0,
                        "stage_busy_s": busy, "stage_walk_s": walk,
                        "stage_compute_s": {k: {s: v[0] / v[1] for (kk, s), v in sorted(times.items()) if kk == k}
                                            for k in ("F", "B")},
                        "schedule": (n, m, "gpipe", 1)}
        return total

    def _flush(self, mbs, n_global, dtype, device, busy, times, ends) -> torch.Tensor:
        """One GPipe flush of micro-batches ``mbs`` over the stage threads; returns its loss sum."""
        n, m, last = self.n_stages, len(mbs), self.n_stages - 1
        acts, saved, grads, sums = {}, {}, {}, {}

        def timed(kind, s, fn):
            def run():
                t = time.perf_counter()
                fn()
                ends[s] = time.perf_counter()
                dt = ends[s] - t
                busy[s] += dt
                acc = times.setdefault((kind, s), [0.0, 0])
                acc[0] += dt
                acc[1] += 1
            return run

        def fwd(i, s):
            def run():
                inp = None
                if s > 0:
                    inp = acts.pop((i, s)).requires_grad_()
                with autocast_ctx(dtype, device):
                    out = self.stages[s].run_chunk(0, mbs[i][0] if s == 0 else inp)
                if s == last:
                    loss = self.loss_sum(out, mbs[i][1])
                    sums[i] = loss.detach()
                    out = loss / n_global
                else:
                    acts[(i, s + 1)] = out.detach()
                saved[(i, s)] = (inp, out)
            return timed("F", s, run)

        def bwd(i, s):
            def run():
                inp, out = saved.pop((i, s))
                if s == last:
                    torch.autograd.backward(out)
                else:
                    torch.autograd.backward(out, grads.pop((i, s)))
                if s > 0:
                    grads[(i, s - 1)] = inp.grad
            return timed("B", s, run)

        for k in range(m + n - 1):  # forward clocks: stage j runs micro-batch k - j
            self._clock({j: fwd(k - j, j) for j in range(n) if 0 <= k - j < m})
        for k in range(m + n - 1):  # backward clocks: stage j runs micro-batch k - (n - 1 - j)
            self._clock({j: bwd(k - (last - j), j) for j in range(n) if 0 <= k - (last - j) < m})
        if acts or saved or grads:
            raise RuntimeError("threaded pipeline flush ended with undelivered tensors")
        return sum((sums[i].double().cpu() for i in range(m)), torch.zeros((), dtype=torch.float64))

    def last_step_timing(self) -> dict:
        """Timing of the last ``forward_backward``: ``busy_s``/``idle_s`` summed over the stage
        threads, ``bubble_fraction`` = max over stages of idle / (busy + idle), a stage's idle
        time being its walk (from each flush's start to the end of its last task there,
        ``stage_walk_s``) minus its compute (``stage_busy_s``),
        ``stage_compute_s`` ({"F"|"B": {stage: mean seconds per micro-batch}}) and ``schedule``
        (n_stages, m, "gpipe", 1) -- the same keys as ``PipelineStrategy.last_step_timing`` (each
        stage thread plays a pipeline rank), so ``bench train`` accounts it alike."""
        return dict(self._timing)
