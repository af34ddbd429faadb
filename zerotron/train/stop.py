"""What stops a run on purpose, importable before torch: :class:`RunStopped` (exit code and the one
line rank 0 prints), the stop signals, the launcher's restart note, and the handlers that cover a
run's start-up (:func:`install_startup_stop`: from the ``train`` command's first line until
``lifecycle.GracefulStop`` takes over for the step loop; ``import torch`` alone takes seconds)."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from ..launch import RESTART_NOTE_ENV

__all__ = ["EXIT_GUARD", "STOP_SIGNALS", "RunStopped", "StartupStopped", "install_startup_stop", "restart_note",
           "restore_handlers"]

EXIT_GUARD = 3
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


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
    (killed by SIGKILL: ...)"`` (written by ``launch.restart_hooks`` before the agent's SIGTERM to
    the survivors), or None: no restart is under way, or this worker is not one of ``--nproc
    --max-restarts`` (plain torchrun)."""
    path = os.environ.get(RESTART_NOTE_ENV)
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def install_startup_stop() -> dict:
    """Until ``lifecycle.GracefulStop`` takes over for the step loop (imports, config, data, model
    build, checkpoint load, process group), make SIGTERM / SIGHUP / SIGINT raise
    :class:`StartupStopped` (exit 128 + S) whose line says that the run stopped before its first
    training step and that nothing was saved, instead of a silent death by the signal (exit 143
    and no word). A SIGTERM by which the ``--max-restarts`` launcher stops a failed attempt still
    kills at once, as in GracefulStop. Returns the previous handlers, for :func:`restore_handlers`;
    {} outside the main thread (where Python installs no handler: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handle(signum, frame):
        if signum == signal.SIGTERM and restart_note():  # stopped for a restart: die by the signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)  # the launcher may forward the same signal again
        raise StartupStopped(f"{signal.Signals(signum).name} before the first training step: stopped; nothing was "
                         "saved (checkpoints already in the run directory are untouched)", 128 + signum)

    return {s: signal.signal(s, handle) for s in STOP_SIGNALS}


def restore_handlers(prev: dict) -> None:
    """Put back the signal handlers that :func:`install_startup_stop` returned."""
    for s, h in prev.items():
        signal.signal(s, h)
