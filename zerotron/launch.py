"""``--nproc N``: start N local workers through torch's elastic launcher (what ``torchrun`` runs).

The parent process validates everything it can first (so a bad config gives one clean error, not N),
then re-runs ``python -m zerotron <argv>`` in N workers with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
set. If one worker fails, the elastic agent stops the others and this returns non-zero. Workers
ask to be signalled when the launcher dies (:func:`die_with_parent`, from ``init_distributed``).
Ctrl-C (SIGINT to the launcher and its workers) ends in one line and exit code 130: the workers exit
quietly (``cli.main``), the agent stops them, and :func:`launch` reports the signal.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys


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


@contextlib.contextmanager
def quiet_elastic_logs(level: int = logging.ERROR):
    """Raise the level of torch elastic's loggers (each sets its own, from $LOGLEVEL) to ``level``
    while the block runs: no "Received 2 death signal" / "Sending process N closing signal" warnings
    on Ctrl-C. Errors (a failed worker's summary) still show."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith("torch.distributed.elastic") or n == "torch.distributed.run"]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, level))
    try:
        yield
    finally:
        for lg, lv in zip(loggers, saved):
            lg.setLevel(lv)


# worker exit codes that mean "stopped on purpose; rank 0 printed the reason": a guard (3, see
# train.lifecycle) or a graceful stop after signal S (128 + S)
QUIET_EXIT_CODES = (3, 128 + signal.SIGHUP, 128 + signal.SIGINT, 128 + signal.SIGTERM)


_STOPPED_BY_AGENT = (-signal.SIGTERM, 128 + signal.SIGTERM)  # what the agent's SIGTERM leaves


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"killed by {name}"
        if -code == signal.SIGKILL:
            text += ": possibly out of memory (check dmesg)"
        return text
    return f"exit code {code}"


def _killed_by_signal(code) -> bool:
    return isinstance(code, int) and code < 0


def describe_failures(failures: dict) -> str:
    """One line naming the worker that failed FIRST (``failures``: global rank -> torch elastic
    ProcessFailure, with ``exitcode`` and ``timestamp``). Workers that the agent stopped with SIGTERM
    after another failed are victims, not culprits: the culprit is the earliest failure (then the
    lowest rank) among those that did not end by SIGTERM; only if every worker did is it the earliest.
    A worker killed by a signal (kill -9, out of memory) comes before workers that exited with a code:
    its peers then fail their next collective (connection reset, exit 1) within the same second, and
    torch elastic's timestamps have one-second resolution."""
    if not failures:
        return "a worker failed; the other workers were stopped. See the messages above."
    culprits = {r: f for r, f in failures.items() if f.exitcode not in _STOPPED_BY_AGENT} or failures
    first = min(culprits, key=lambda r: (not _killed_by_signal(culprits[r].exitcode),
                                         getattr(culprits[r], "timestamp", 0), r))
    others = sorted(r for r in failures if r != first)
    line = f"worker {first} failed first ({_exit_text(failures[first].exitcode)})"
    if len(culprits) > 1:
        line += f"; also failed: {sorted(r for r in culprits if r != first)}"
    victims = [r for r in others if r not in culprits]
    if victims:
        line += f"; the agent then stopped worker(s) {victims}"
    return line + ". See its messages above."


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (what the workers of :func:`launch` get)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(nproc: int, argv: list[str], module: str = "zerotron", shutdown_timeout_s: float = 30) -> int:
    """Run ``python -m <module> <argv>`` in ``nproc`` local worker processes; return an exit code.

    ``argv`` must not contain ``--nproc`` (the workers would launch again). Uses
    ``torch.distributed.run`` with ``--standalone`` (a free local rendezvous port) and
    ``--max-restarts 0``. A SIGTERM/SIGHUP/SIGINT to this process is forwarded to the workers by
    the elastic agent, which waits ``shutdown_timeout_s`` seconds for them before SIGKILL; then
    this prints one line and returns 128 + the signal. Raises ValueError if ``nproc < 1``."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
         f"--shutdown-timeout={max(1, int(shutdown_timeout_s + 0.999))}", "-m", module, *argv])
    try:
        with quiet_elastic_logs():
            run(args)
    except SignalException as e:  # the workers got the signal too and have stopped (or been killed)
        sig = signal.Signals(e.sigval)
        print(f"zerotron: interrupted ({sig.name}); the {nproc} workers were stopped", file=sys.stderr)
        return 128 + int(sig)
    except ChildFailedError as e:
        failures = getattr(e, "failures", {}) or {}
        codes = {f.exitcode for f in failures.values()}
        quiet = codes & set(QUIET_EXIT_CODES)
        if quiet and codes <= quiet | {-signal.SIGTERM, -signal.SIGKILL}:  # stopped on purpose (the rest
            return max(quiet)                                              # stopped by the agent after)
        print(f"zerotron: {describe_failures(failures)}", file=sys.stderr)
        return 1
    return 0
