"""Run lifecycle: the per-step agreement of all ranks (non-finite guard, graceful stop on a
signal) and fault-injection hooks for tests. The run-directory lock is ``train.run_lock``,
automatic restarts ``train.restarts``.

Per step every rank contributes three numbers to one small MAX all-reduce over the world
(:meth:`StepGuard.decide`): "my loss or grad norm is not finite", "I received signal S" and "my
run files could not be written" (rank 0's metrics.jsonl append of the previous step, with
checkpoint.on_error = stop). All ranks see the same maxima, so they skip the same optimizer steps
and stop after the same step.

Exit codes (the ``RunStopped`` family; rank 0 prints the one line that says why):
    3            stopped by a guard (non-finite limit; a checkpoint or metrics.jsonl line that could
                 not be written, with checkpoint.on_error = stop, or the final checkpoint, or the one
                 of a signalled stop, or metrics still unwritten at the end)
    128 + S      stopped by signal S after writing a checkpoint (143 SIGTERM, 129 SIGHUP, 130 SIGINT)

Fault hooks (environment variables, read at the start of ``fit``; for tests):
    ZEROTRON_FAULT_NAN_AT_STEPS    "5" or "3,4,5": make the gradient non-finite at these 1-based steps
    ZEROTRON_FAULT_NAN_RANK        only on this global rank (default: every rank)
    ZEROTRON_FAULT_STEP_SLEEP_S    sleep this long after each step (gives a test time to send a signal)
    ZEROTRON_FAULT_GATE            "N:PATH" or "N:PATH,M:PATH2": after step N (its record and save; N =
                                   the start step: before the first step, still in start-up), every rank
                                   creates PATH.rank<R> and waits until PATH exists (a test's action
                                   between two steps, awaited: no margin of sleeps; :func:`fault_gate`)
    ZEROTRON_FAULT_KILL_AT_STEP    kill -9 this process after this 1-based step (trainer.fit) ...
    ZEROTRON_FAULT_KILL_RANK       ... on this global rank (default 0). Only in the first attempt
                                   (TORCHELASTIC_RESTART_COUNT unset or 0), so a restart runs through;
                                   "1,5": after step 1 in the first attempt, step 5 in the second, ...
"""
from __future__ import annotations

import math
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import comm
from ..launch_worker import mark_started
from .restarts import restart_count
from .stop import EXIT_GUARD, STOP_SIGNALS, RunStopped, restart_note  # noqa: F401 (API: lifecycle.RunStopped)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agree_max(values: list[float], device: torch.device | None = None) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks of the world (one float64 all-reduce;
    no collective at world size 1). Every rank gets the same list."""
    if _world() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, op=dist.ReduceOp.MAX, tag="lifecycle")
    return t.cpu().tolist()


def resume_command() -> str:
    """The command that continues this run: the launcher's (``ZEROTRON_RESUME_CMD``) or this
    process's own arguments, with ``--resume`` added."""
    cmd = os.environ.get("ZEROTRON_RESUME_CMD")
    if cmd:
        return cmd
    argv = sys.argv[1:]
    return shlex.join(["zerotron", *argv, *([] if "--resume" in argv else ["--resume"])])


class GracefulStop:
    """SIGTERM / SIGHUP / SIGINT handler of one training process.

    The first signal only records its number (:attr:`pending`); the step loop agrees on it across
    ranks, finishes the step, writes a checkpoint and raises. If that takes longer than
    ``grace_s`` seconds, or a second signal comes more than ``debounce_s`` after the first (the
    same signal reaching a worker twice, from a process-group kill and from the launcher that
    forwards it, arrives within milliseconds), the process exits at once with 128 + signal and
    without a checkpoint. A SIGTERM by which the ``--max-restarts`` launcher stops the survivors of
    a failed attempt (:func:`restarts.restart_note`) also exits at once (a peer is dead: no step or
    checkpoint can complete; the new workers resume from the newest checkpoint), saying so in one
    line (``announce``), killed by that SIGTERM (exit -15, not the 143 of a stop on purpose, which
    would cancel the restart). Only the main thread may call :meth:`install`."""

    def __init__(self, grace_s: float, announce: bool, debounce_s: float = 2.0):
        self.grace_s, self.announce, self.debounce_s = grace_s, announce, debounce_s
        self.pending = 0
        self._t0 = 0.0
        self._prev: dict = {}
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        for s in STOP_SIGNALS:
            self._prev[s] = signal.signal(s, self._handle)
        mark_started()  # the --nproc launcher: a stop is this loop's now (rank 0 says it), not a start-up's

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        note = restart_note() if signum == signal.SIGTERM else None
        if note:  # the launcher stops this attempt to restart it: not a user's stop
            if self.announce:
                print(f"zerotron: stopped for a restart after {note}: exiting at once, without a checkpoint "
                      "(the launcher starts the workers again)", file=sys.stderr, flush=True)
            # die BY the signal (exit -15, what the agent's stop leaves), not with 143: 128 + S means
            # "stopped on purpose", which the launcher does not restart (launch_failures.NO_RESTART_EXIT_CODES)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the default action ends the process; not reached
            os._exit(128 + signum)
        if not self.pending:
            self.pending, self._t0 = signum, time.monotonic()
            if self.announce:
                print(f"zerotron: {name}: finishing the current step, then writing a checkpoint (at most "
                      f"{self.grace_s:g} s; a second signal exits at once)", file=sys.stderr, flush=True)
            why = f"not stopped within train.stop_grace_s = {self.grace_s:g} s"
            self._timer = threading.Timer(self.grace_s, self._exit_now, (signum, why))
            self._timer.daemon = True
            self._timer.start()
        elif time.monotonic() - self._t0 > self.debounce_s:
            self._exit_now(signum, f"second signal ({name})")

    def _exit_now(self, signum: int, why: str) -> None:
        if self.announce:
            print(f"zerotron: {why}: exiting now without a checkpoint; work since the newest checkpoint "
                  "is lost", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def done(self) -> None:
        """The checkpoint is written: ignore further signals (the launcher may forward one while
        this process exits) and stop the grace timer."""
        if self._timer:
            self._timer.cancel()
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def uninstall(self) -> None:
        if self._timer:
            self._timer.cancel()
        for s, h in self._prev.items():
            signal.signal(s, h)
        self._prev = {}


def _fault_steps() -> set[int]:
    raw = os.environ.get("ZEROTRON_FAULT_NAN_AT_STEPS", "")
    return {int(x) for x in raw.split(",") if x.strip()}


class StepGuard:
    """Decides, identically on every rank, whether an optimizer step is applied, and whether the
    run stops after it (see the module docstring).

    ``mode``: "skip" or "stop" (train.nonfinite); ``limit``: consecutive skips before stopping
    (train.nonfinite_limit); ``signals``: a :class:`GracefulStop` or None."""

    def __init__(self, mode: str, limit: int, signals: GracefulStop | None, rank: int,
                 device: torch.device | None = None):
        self.mode, self.limit, self.signals, self.rank, self.device = mode, limit, signals, rank, device
        self.step = 0              # 1-based step being computed (set by the trainer)
        self.skipped = 0           # steps skipped in this process's run
        self.consecutive = 0
        self.last_skipped = False
        self.stop_signal = 0       # agreed signal number (0 = none)
        self.io_failed = False     # this rank's run files could not be written (set by the trainer)
        self.stop_io = False       # agreed: some rank's io_failed (checkpoint.on_error = stop)
        self._nan_steps = _fault_steps()
        nan_rank = os.environ.get("ZEROTRON_FAULT_NAN_RANK", "")
        self._nan_here = not nan_rank or int(nan_rank) == rank
        self.sleep_s = float(os.environ.get("ZEROTRON_FAULT_STEP_SLEEP_S", "0") or 0)

    def before_clip(self, strategy) -> None:
        """Fault hook: poison one gradient element of this rank (after the gradient sync)."""
        if self.step in self._nan_steps and self._nan_here:
            for p in strategy.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    g.view(-1)[0] = float("nan")
                    break

    def decide(self, loss: float, grad_norm: float) -> bool:
        """Collective (every rank, every step): True when the step must be skipped because the
        loss or gradient norm is not finite on *any* rank. Also agrees on a pending signal and on
        :attr:`io_failed` (a failed metrics.jsonl append of the previous step) in the same
        all-reduce of three float64."""
        bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
        sig = self.signals.pending if self.signals else 0
        bad_any, sig_any, io_any = agree_max([float(bad), float(sig), float(self.io_failed)], self.device)
        self.stop_signal = int(sig_any)
        self.stop_io = self.stop_io or io_any > 0
        self.last_skipped = bad_any > 0
        if self.last_skipped:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        return self.last_skipped

    def check(self, loss: float, grad_norm: float, newest: Path | None) -> None:
        """After a step: raise RunStopped (exit 3) when the non-finite policy says stop."""
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if not self.last_skipped:
            return
        if self.mode == "skip" and self.consecutive < self.limit:
            if self.rank == 0:  # the global loss and norm: the same on every rank
                print(f"zerotron: warning: non-finite loss or gradient norm at step {self.step} on some rank "
                      f"(rank 0: loss {loss}, grad norm {grad_norm}); the update was skipped on every rank ({self.consecutive} of "
                      f"{self.limit - 1} allowed in a row, train.nonfinite_limit = {self.limit})", file=sys.stderr,
                      flush=True)
            return
        why = ("train.nonfinite = stop" if self.mode == "stop" else
               f"{self.consecutive} consecutive skipped steps (train.nonfinite_limit = {self.limit})")
        keep = f"the newest good checkpoint is {newest}" if newest else "no checkpoint was written"
        raise RunStopped(f"non-finite loss or gradient norm at step {self.step} (loss {loss}, grad norm "
                         f"{grad_norm}); stopped after {why}, the optimizer step was not applied; {keep}; "
                         "lower train.lr or raise train.warmup_steps, then resume with --resume")

    def signal_stop(self, step: int, saved: Path) -> RunStopped:
        """The exception that ends a run stopped by the agreed signal after ``step`` (checkpoint
        ``saved``)."""
        name = signal.Signals(self.stop_signal).name
        return RunStopped(f"stopped by {name} at step {step}; checkpoint written ({saved}); resume with: "
                          f"{resume_command()}", 128 + self.stop_signal)


def agree_io(guard: StepGuard) -> bool:
    """Collective: agree on ``guard.io_failed`` outside a step (after the last one, whose failure
    no later :meth:`StepGuard.decide` sees). Sets and returns ``guard.stop_io``."""
    guard.stop_io = guard.stop_io or agree_max([float(guard.io_failed)], guard.device)[0] > 0
    return guard.stop_io


def params_finite(strategy, device: torch.device | None = None) -> bool:
    """True on every rank iff every parameter of every rank is finite (one MAX all-reduce)."""
    bad = 0.0
    with torch.no_grad():
        for p in strategy.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if t.numel() and not bool(torch.isfinite(t).all()):
                bad = 1.0
                break
    return agree_max([bad], device)[0] == 0


def fault_gate(step: int, rank: int, timeout_s: float = 300.0) -> None:
    """Fault hook (module docstring, ZEROTRON_FAULT_GATE): if a gate names ``step``, create
    ``PATH.rank<rank>`` (this rank has arrived) and wait until ``PATH`` exists. Raises RuntimeError
    when it does not appear within ``timeout_s``."""
    for entry in filter(None, os.environ.get("ZEROTRON_FAULT_GATE", "").split(",")):
        at, _, path = entry.partition(":")
        if int(at) != step:
            continue
        Path(f"{path}.rank{rank}").touch()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ZEROTRON_FAULT_GATE: {path} did not appear within {timeout_s:g} s after step {step}")
            time.sleep(0.02)


def fault_kill_step() -> int:
    """The step after which ZEROTRON_FAULT_KILL_AT_STEP kills this attempt's process (-1: none):
    entry ``restart_count()`` of the comma-separated list."""
    steps = os.environ.get("ZEROTRON_FAULT_KILL_AT_STEP", "").split(",")
    attempt = restart_count()
    return int(steps[attempt]) if attempt < len(steps) and steps[attempt].strip() else -1
