"""The worker's side of a ``--nproc`` launch (:func:`zerotron.launch.launch`): whether this process is
a worker, the environment variables through which the launcher talks to its workers (the restart note,
the folder of lines said once, the start-up mark) and the kernel's tie of a worker to its launcher
(:func:`die_with_parent`). Imported by every worker (``distributed.mesh``): standard library only.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

RESTART_NOTE_ENV = "ZEROTRON_RESTART_NOTE"
"""environment variable of ``--max-restarts`` workers: the file in which the launcher writes, before
the survivors are stopped for a restart, the one-line description of the worker that failed"""


ERROR_DIR_ENV = "ZEROTRON_ERROR_DIR"
"""environment variable of :func:`zerotron.launch.launch`'s workers: a folder of the launch in which
:func:`say_once` marks the lines already printed, so a user error that every worker finds is printed once, and
:func:`mark_started` marks that the workers are past their start-up"""


STARTED_MARK = "started"
"""the file :func:`mark_started` creates in the :data:`ERROR_DIR_ENV` folder"""


def launched_worker() -> bool:
    """True in a worker started by :func:`zerotron.launch.launch` (zerotron's ``--nproc`` launcher, which
    reports a stop signal for all its workers), False elsewhere (one process, a plain torchrun worker)."""
    return in_worker() and bool(os.environ.get(ERROR_DIR_ENV))


def mark_started() -> None:
    """In a worker of :func:`zerotron.launch.launch`: say that this worker has finished its start-up (a
    training run entering its step loop), so that the launcher, stopped by a signal, no longer says that
    the workers were stopped before they started. Nothing elsewhere."""
    if launched_worker():
        with contextlib.suppress(OSError):
            Path(os.environ[ERROR_DIR_ENV], STARTED_MARK).touch()


def say_once(line: str) -> None:
    """Print ``line`` on stderr once per :func:`zerotron.launch.launch`: the workers of one launch share the
    folder :data:`ERROR_DIR_ENV` names, and the first to print a given line creates a file named for its
    SHA-256 there (``O_EXCL``: atomic on a local filesystem); the others leave that line out. Other
    lines (a rank's own path, another error) still print. Outside a launch (one process, torchrun),
    it prints."""
    import hashlib

    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and in_worker():
        try:
            os.close(os.open(Path(folder) / hashlib.sha256(line.encode()).hexdigest()[:32],
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        except OSError:  # the folder went away or is unwritable: better twice than never
            pass
    print(line, file=sys.stderr, flush=True)


def in_worker() -> bool:
    """True when this process was started by torchrun / the elastic launcher (RANK is set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Linux: have the kernel send ``sig`` to this worker when its parent (the launcher's agent)
    dies, so ``kill -9`` of the launcher does not leave workers running (and writing checkpoints).
    Returns False where unsupported. Sends ``sig`` at once if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ppid = os.getppid()
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != ppid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return True
