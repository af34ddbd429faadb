"""Patches to torch elastic's launcher, each for the duration of one :func:`zerotron.launch.launch`:
its loggers quieted (:func:`quiet_elastic_logs`), no restart of workers that stopped on purpose and a
note for the survivors of a restart (:func:`restart_hooks`), and no stop signal let in while the
workers are being started (:func:`whole_spawns`). They wrap torch 2.x private API (named in each);
torch is imported only inside them.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path

from .launch_failures import NO_RESTART_EXIT_CODES, describe_first_failure


@contextlib.contextmanager
def quiet_elastic_logs(level: int = logging.ERROR):
    """Raise the level of torch elastic's loggers (each sets its own, from $LOGLEVEL) to ``level``
    while the block runs: no "Received 2 death signal" / "Sending process N closing signal" warnings
    on Ctrl-C), and drop their ``failed (exitcode: N)`` error (zerotron's own line says it:
    :func:`_worker_failed_summary`). Other errors still show."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith("torch.distributed.elastic") or n == "torch.distributed.run"]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, level))
        lg.addFilter(_worker_failed_summary)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, saved):
            lg.setLevel(lv)
            lg.removeFilter(_worker_failed_summary)


def _worker_failed_summary(record: logging.LogRecord) -> bool:
    """Drop torch elastic's ``E... failed (exitcode: N) local_rank: ... of binary: ...`` error,
    whatever N: zerotron says it in its own line (a user error or a guard: the worker's line,
    :func:`~zerotron.launch_worker.say_once`; a signal stop: rank 0's; any other failure:
    :func:`~zerotron.launch_failures.describe_failures`, which
    names the worker that failed first; a restart: the ``on_restart`` line), so torch's was a second,
    glog-formatted line beside it (a hung peer showed it, issue "runs that never lose work")."""
    return not str(record.msg).startswith("failed (exitcode: ")


def _write_note(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader sees the whole line or no file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def restart_hooks(on_restart, note_path: str | Path | None = None):
    """While the block runs, torch elastic's local agent (i) does not restart workers that stopped
    on purpose (an exit code in :data:`NO_RESTART_EXIT_CODES`), (ii) when it will restart, writes
    :func:`describe_first_failure` of the failed attempt to ``note_path`` (if given) before it stops
    the surviving workers (also before the SIGTERM torch's ``SubprocessContext._poll`` sends them
    from inside ``_monitor_workers`` when it sees the failure), and removes that file before it starts the new ones, and (iii) calls
    ``on_restart(failure, count, max_restarts)`` before it starts the workers again, after the old
    ones are stopped: ``failure`` is :func:`describe_first_failure` of the failed attempt, ``count``
    the 1-based restart number. Wraps two methods of ``LocalElasticAgent`` (torch 2.x private API:
    ``_monitor_workers`` returns the failures, ``_initialize_workers`` starts a worker group) and
    ``PContext.close`` (which stops the workers)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    monitor, initialize = LocalElasticAgent._monitor_workers, LocalElasticAgent._initialize_workers
    own = {n: LocalElasticAgent.__dict__.get(n) for n in ("_monitor_workers", "_initialize_workers")}
    close = PContext.close
    failed: dict = {}
    polling: dict = {}  # the agent and worker group while _monitor_workers runs

    def _close(pc, *args, **kwargs):
        # torch's SubprocessContext._poll SIGTERMs the survivors (close()) as soon as it sees a
        # failure, INSIDE _monitor_workers: the note must be on disk before that, not after it
        agent, group, fails = polling.get("agent"), polling.get("group"), getattr(pc, "_failures", None)
        if (note_path is not None and agent is not None and fails and agent._remaining_restarts > 0
                and not {f.exitcode for f in fails.values()} & set(NO_RESTART_EXIT_CODES)):
            ranks = {w.local_rank: w.global_rank for w in group.workers}
            _write_note(Path(note_path), describe_first_failure({ranks.get(lr, lr): f for lr, f in fails.items()}))
        return close(pc, *args, **kwargs)

    def _monitor(self, worker_group):
        polling.update(agent=self, group=worker_group)
        try:
            result = monitor(self, worker_group)
        finally:
            polling.clear()
        if result.is_failed():
            if {f.exitcode for f in result.failures.values()} & set(NO_RESTART_EXIT_CODES):
                self._remaining_restarts = 0  # stopped on purpose: fail now, as without restarts
            failed.clear()
            failed.update(result.failures)
            if note_path is not None and self._remaining_restarts > 0 and failed:
                _write_note(Path(note_path), describe_first_failure(failed))  # before the survivors' SIGTERM
        return result

    def _initialize(self, worker_group):
        spec = worker_group.spec
        count = spec.max_restarts - self._remaining_restarts
        if count > 0 and on_restart is not None:
            on_restart(describe_first_failure(failed) if failed else "a worker failed", count, spec.max_restarts)
        failed.clear()
        if note_path is not None:
            Path(note_path).unlink(missing_ok=True)  # the new workers are not being stopped
        return initialize(self, worker_group)

    LocalElasticAgent._monitor_workers, LocalElasticAgent._initialize_workers = _monitor, _initialize
    PContext.close = _close
    try:
        yield
    finally:
        PContext.close = close
        for name, fn in own.items():  # as it was: an own attribute, or inherited from SimpleElasticAgent
            if fn is None:
                delattr(LocalElasticAgent, name)
            else:
                setattr(LocalElasticAgent, name, fn)


@contextlib.contextmanager
def whole_spawns():
    """While the block runs, torch elastic's ``SubprocessContext._start`` (torch 2.x private API: it
    starts the workers in one dict comprehension, after ``PContext.start`` set the agent's stop
    signal handlers) holds back a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) that arrives while
    the workers are being started, and raises it (the agent's handler: ``SignalException``) once
    all of them are recorded. Raised mid-way, the comprehension lost the workers started so far:
    the agent's shutdown then stopped none of them, and the launcher exited while they ran on
    (rank 1 was seen alive ~30 s after it)."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    start = SubprocessContext._start

    def _start(self):
        if threading.current_thread() is not threading.main_thread():
            return start(self)
        pending: list[int] = []
        launcher = os.getpid()

        def hold(signum, frame):
            if os.getpid() != launcher:  # a forked worker before it reset its handlers (launch_fork):
                signal.signal(signum, signal.SIG_DFL)  # the signal is its own, and ends it
                os.kill(os.getpid(), signum)
            pending.append(signum)

        held = [s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
                if callable(signal.getsignal(s))]
        prev = {s: signal.signal(s, hold) for s in held}
        try:
            return start(self)
        finally:
            for s, h in prev.items():
                signal.signal(s, h)
            if pending:  # every started worker is in subprocess_handlers now: the agent stops them all
                prev[pending[0]](pending[0], None)

    SubprocessContext._start = _start
    try:
        yield
    finally:
        SubprocessContext._start = start
