"""What stops a run on purpose, importable before torch: :class:`RunStopped` (exit code and the one
line rank 0 prints), the stop signals, the launcher's restart note, and the handlers that cover a
run's start-up (:func:`install_startup_stop`: from the ``train`` command's first line until
``lifecycle.GracefulStop`` takes over for the step loop; ``import torch`` alone takes seconds), with
:data:`STARTUP_STOP`, the line that says such a stop."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from ..launch_worker import RESTART_NOTE_ENV, die_with_parent, in_worker, launched_worker

__all__ = ["EXIT_GUARD", "STARTUP_STOP", "STOP_SIGNALS", "RunStopped", "StartupStopped", "install_startup_stop",
           "loop_ended", "restart_note", "restore_handlers"]

EXIT_GUARD = 3
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
STARTUP_STOP = ("before the first training step: stopped; nothing was saved (checkpoints already in the run "
                "directory are untouched)")
"""after the signal's name: the one line of a stop during start-up (one process, or the launcher's
for its workers)"""
_AFTER_LOOP: list[str] = []  # the line after the signal's name once the step loop is over (loop_ended)


class RunStopped(Exception):
    """The run stopped on purpose, on every rank at the same step. ``exit_code`` is the process
    exit status; ``str(e)`` is the one line rank 0 prints."""

    def __init__(self, message: str, exit_code: int = EXIT_GUARD):
        super().__init__(message)
        self.exit_code = exit_code


class StartupStopped(RunStopped):
    """A stop signal before the first training step (:func:`install_startup_stop`): each rank
    stops where it is, not at an agreed step (so no barrier on the way out)."""


def restart_note() -> str | None:
    """Why the ``--nproc`` launcher is stopping this worker for a restart, e.g. ``"worker 1 died
    (killed by SIGKILL: ...)"`` (written by ``launch_agent.restart_hooks`` before the agent's SIGTERM to
    the survivors), or None: no restart is under way, or this worker is not one of ``--nproc
    --max-restarts`` (plain torchrun)."""
    path = os.environ.get(RESTART_NOTE_ENV)
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def loop_ended(step: int) -> None:
    """The step loop is over (its ``GracefulStop`` uninstalled, this process's start-up handlers of
    :func:`install_startup_stop` back for the end-of-run sample and summary): a stop signal from
    now on says that training finished at ``step`` and its checkpoints are kept, not that the run
    stopped before its first step with nothing saved (what a SIGTERM during a long
    ``log.sample_tokens`` sample said)."""
    _AFTER_LOOP[:] = [f"after the last training step ({step}): stopped before the end-of-run sample and "
                      "summary.json were written; training finished and its checkpoints are kept"]


def install_startup_stop() -> dict:
    """Until ``lifecycle.GracefulStop`` takes over for the step loop (imports, config, data, model
    build, checkpoint load, process group), make SIGTERM / SIGHUP / SIGINT raise
    :class:`StartupStopped` (exit 128 + S) whose line says that the run stopped before its first
    training step and that nothing was saved, instead of a silent death by the signal (exit 143
    and no word). A SIGTERM by which the ``--max-restarts`` launcher stops a failed attempt still
    kills at once, as in GracefulStop. In a worker of the ``--nproc`` launcher (``launch.launch``)
    the stop signals instead keep (or get back) their default action, death by the signal: the
    launcher says the one line for all workers (``launch(startup_stop=...)``), and a Python handler
    would run only once the worker's C++ call returns -- a rank waiting in ``init_process_group`` or
    a collective for a peer that already stopped would hold out until the agent's SIGKILL, 30 s
    later. A worker is also tied to the launcher here (``die_with_parent``), not only from
    ``init_distributed`` on. Returns the previous handlers, for :func:`restore_handlers`; {} outside
    the main thread (where Python installs no handler: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    if in_worker():
        die_with_parent()  # a launcher that dies before init_distributed takes this worker with it
    if launched_worker():
        return {s: signal.signal(s, signal.SIG_DFL) for s in STOP_SIGNALS}

    def handle(signum, frame):
        if signum == signal.SIGTERM and restart_note():  # stopped for a restart: die by the signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)  # the launcher may forward the same signal again
        raise StartupStopped(f"{signal.Signals(signum).name} {(_AFTER_LOOP or [STARTUP_STOP])[0]}", 128 + signum)

    _AFTER_LOOP.clear()  # a new run (one process may run several: the Python API, tests)
    return {s: signal.signal(s, handle) for s in STOP_SIGNALS}


def restore_handlers(prev: dict) -> None:
    """Put back the signal handlers that :func:`install_startup_stop` returned."""
    for s, h in prev.items():
        signal.signal(s, h)
