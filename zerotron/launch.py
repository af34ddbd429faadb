"""``--nproc N``: start N local workers through torch's elastic launcher (what ``torchrun`` runs).

The parent process validates everything it can first (so a bad config gives one clean error, not N),
then re-runs ``python -m zerotron <argv>`` in N workers with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
set. If one worker fails, the elastic agent stops the others and this returns non-zero. Workers
ask to be signalled when the launcher dies (:func:`~zerotron.launch_worker.die_with_parent`, from
``init_distributed``).
Ctrl-C (SIGINT to the launcher and its workers) ends in one line and exit code 130: the workers exit
quietly (``cli.main``), the agent stops them, and :func:`launch` reports the signal.

Restarts (``max_restarts`` > 0): when a worker dies, the agent stops the others and starts all of
them again (``TORCHELASTIC_RESTART_COUNT`` = 1, 2, ... in the new workers), up to ``max_restarts``
times. :func:`~zerotron.launch_agent.restart_hooks` lets the caller say one line first (which worker
failed, from where the new workers continue), once the old workers are stopped. A worker that
stopped on purpose (:data:`~zerotron.launch_failures.NO_RESTART_EXIT_CODES`: a user error, a guard, a
signal) is not restarted: the same run would stop the same way again. Before the agent stops the
surviving workers (SIGTERM) for a restart, the launcher writes which worker failed into the file
named by :data:`~zerotron.launch_worker.RESTART_NOTE_ENV` in the workers' environment, so a survivor
can say why it is stopped (``train.restarts.restart_note``) rather than report the SIGTERM as a
user's stop.

The workers' side (environment, :func:`~zerotron.launch_worker.say_once`) is
:mod:`zerotron.launch_worker`; the patches to torch elastic's agent :mod:`zerotron.launch_agent`; the
failure lines :mod:`zerotron.launch_failures`.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from .launch_agent import quiet_elastic_logs, restart_hooks, whole_spawns
from .launch_failures import QUIET_EXIT_CODES, describe_failures, first_failure
from .launch_worker import ERROR_DIR_ENV, RESTART_NOTE_ENV, STARTED_MARK


def strip_nproc(argv: list[str], options: tuple[str, ...] = ("--nproc",)) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (what the workers of :func:`launch` get), or
    without each of the value-taking ``options``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            out.append(a)
    return out


launched = False  # this process ran launch(): the zerotron command skips its last collections (cli.main)


def max_local_nproc() -> int:
    """The most worker processes :func:`launch` starts on one machine: 8 per CPU core, at least 64."""
    return max(64, 8 * (os.cpu_count() or 1))


def launch(nproc: int, argv: list[str], module: str = "zerotron", shutdown_timeout_s: float = 30,
           max_restarts: int = 0, on_restart=None, startup_stop: str | None = None) -> int:
    """Run ``python -m <module> <argv>`` in ``nproc`` local worker processes; return an exit code.

    ``argv`` must not contain ``--nproc`` (the workers would launch again). Uses
    ``torch.distributed.run`` with ``--standalone`` (a free local rendezvous port) and
    ``--max-restarts max_restarts``: after a worker dies the agent stops the others and starts
    all ``nproc`` again, up to that many times (``on_restart``: see
    :func:`~zerotron.launch_agent.restart_hooks`; the survivors of a failed attempt find why they are
    stopped in :data:`~zerotron.launch_worker.RESTART_NOTE_ENV`'s file). A SIGTERM/SIGHUP/SIGINT to
    this process is forwarded to the workers by the elastic agent, which waits ``shutdown_timeout_s``
    seconds for them before SIGKILL; then this prints one line and returns 128 + the signal; with
    ``startup_stop`` and no worker past its start-up (:func:`~zerotron.launch_worker.mark_started`),
    the line is ``zerotron: <SIGNAL> <startup_stop>``, the only line of such a stop (a training run's
    workers die by a stop signal during their start-up, without a word: ``train.stop``). A signal
    that comes while the workers are being started waits until all are
    (:func:`~zerotron.launch_agent.whole_spawns`), so none is left running. A worker that failed first
    with exit code 2 (a user error: it printed its one line) makes this return 2 without a line of
    its own. The workers start with glibc's heap thresholds of
    :mod:`zerotron.host_heap` (unless ``ZEROTRON_HOST_HEAP=release`` or the user set their own).
    With ``ZEROTRON_FORK_WORKERS=1`` the workers are forks of this process instead of fresh
    interpreters (tests: :mod:`zerotron.launch_fork`).
    Raises ValueError if ``nproc < 1`` or ``max_restarts < 0``, or as ``host_heap.wanted``."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nproc > max_local_nproc():  # 100000 began to start that many interpreters (and hung the machine)
        raise ValueError(f"--nproc {nproc} would start {nproc:,} local processes, more than {max_local_nproc()} "
                         f"(8 per core, at least 64) on this machine: use fewer, or torchrun across nodes")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from .host_heap import worker_env
    from .launch_fork import fork_workers
    from .launch_fork import wanted as fork_wanted

    if fork_wanted():
        from .launch_fork import preload

        preload()  # once here, not once per forked worker
    heap_env = worker_env()  # glibc's heap thresholds from the workers' first allocation (host_heap)
    os.environ.update(heap_env)
    note_dir = None
    error_dir = tempfile.mkdtemp(prefix="zerotron-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir  # the workers inherit it: say_once
    if max_restarts:
        # a fresh TCPStore per attempt (hosted by the new rank 0): with the agent's store shared,
        # restarted gloo ranks read the dead attempt's addresses and fail to connect (pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        note_dir = Path(tempfile.mkdtemp(prefix="zerotron-restart-"))
        os.environ[RESTART_NOTE_ENV] = str(note_dir / "note")  # the workers inherit it
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
         f"--shutdown-timeout={max(1, int(shutdown_timeout_s + 0.999))}", "-m", module, *argv])
    global launched
    launched = True
    try:
        with quiet_elastic_logs(), restart_hooks(on_restart, note_dir / "note" if note_dir else None), \
                fork_workers(fork_wanted()), whole_spawns():
            run(args)
    except SignalException as e:  # the workers got the signal too and have stopped (or been killed)
        sig = signal.Signals(e.sigval)
        if startup_stop and not (Path(error_dir) / STARTED_MARK).exists():
            print(f"zerotron: {sig.name} {startup_stop}", file=sys.stderr)
        else:
            print(f"zerotron: interrupted ({sig.name}); the {nproc} workers were stopped", file=sys.stderr)
        return 128 + int(sig)
    except ChildFailedError as e:
        failures = getattr(e, "failures", {}) or {}
        codes = {f.exitcode for f in failures.values()}
        quiet = codes & set(QUIET_EXIT_CODES)
        if quiet and codes <= quiet | {-signal.SIGTERM, -signal.SIGKILL}:  # stopped on purpose (the rest
            return max(quiet)                                              # stopped by the agent after)
        if failures and failures[first_failure(failures)].exitcode == 2:  # a user error the worker named in its
            return 2                                                       # own line (a check only workers make)
        print(f"zerotron: {describe_failures(failures)}", file=sys.stderr)
        return 1
    finally:
        for key in heap_env:  # this process's own later children are not ours to tune
            os.environ.pop(key, None)
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(error_dir, ignore_errors=True)
        if note_dir is not None:
            os.environ.pop(RESTART_NOTE_ENV, None)
            shutil.rmtree(note_dir, ignore_errors=True)
    return 0
