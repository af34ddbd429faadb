"""``--nproc N``: start N local workers through torch's elastic launcher (what ``torchrun`` runs).

The parent process validates everything it can first (so a bad config gives one clean error, not N),
then re-runs ``python -m zerotron <argv>`` in N workers with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
set. If one worker fails, the elastic agent stops the others and this returns non-zero. Workers
ask to be signalled when the launcher dies (:func:`die_with_parent`, from ``init_distributed``).
Ctrl-C (SIGINT to the launcher and its workers) ends in one line and exit code 130: the workers exit
quietly (``cli.main``), the agent stops them, and :func:`launch` reports the signal.

Restarts (``max_restarts`` > 0): when a worker dies, the agent stops the others and starts all of
them again (``TORCHELASTIC_RESTART_COUNT`` = 1, 2, ... in the new workers), up to ``max_restarts``
times. :func:`restart_hooks` lets the caller say one line first (which worker failed, from where
the new workers continue), once the old workers are stopped. A worker that stopped on purpose
(:data:`NO_RESTART_EXIT_CODES`: a user error, a guard, a signal) is not restarted: the same run
would stop the same way again. Before the agent stops the surviving workers (SIGTERM) for a
restart, the launcher writes which worker failed into the file named by
:data:`RESTART_NOTE_ENV` in the workers' environment, so a survivor can say why it is stopped
(``train.restarts.restart_note``) rather than report the SIGTERM as a user's stop.
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

RESTART_NOTE_ENV = "ZEROTRON_RESTART_NOTE"
"""environment variable of ``--max-restarts`` workers: the file in which the launcher writes, before
the survivors are stopped for a restart, the one-line description of the worker that failed"""


ERROR_DIR_ENV = "ZEROTRON_ERROR_DIR"
"""environment variable of :func:`launch`'s workers: a folder of the launch in which :func:`say_once`
marks the lines already printed, so a user error that every worker finds is printed once, and
:func:`mark_started` marks that the workers are past their start-up"""

_STARTED = "started"  # the mark of mark_started in the ERROR_DIR_ENV folder


def launched_worker() -> bool:
    """True in a worker started by :func:`launch` (zerotron's ``--nproc`` launcher, which reports a
    stop signal for all its workers), False elsewhere (one process, a plain torchrun worker)."""
    return in_worker() and bool(os.environ.get(ERROR_DIR_ENV))


def mark_started() -> None:
    """In a worker of :func:`launch`: say that this worker has finished its start-up (a training
    run entering its step loop), so that the launcher, stopped by a signal, no longer says that
    the workers were stopped before they started. Nothing elsewhere."""
    if launched_worker():
        with contextlib.suppress(OSError):
            Path(os.environ[ERROR_DIR_ENV], _STARTED).touch()


def say_once(line: str) -> None:
    """Print ``line`` on stderr once per :func:`launch`: the workers of one launch share the folder
    :data:`ERROR_DIR_ENV` names, and the first to print a given line creates a file named for its
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
    :func:`say_once`; a signal stop: rank 0's; any other failure: :func:`describe_failures`, which
    names the worker that failed first; a restart: the ``on_restart`` line), so torch's was a second,
    glog-formatted line beside it (a hung peer showed it, issue "runs that never lose work")."""
    return not str(record.msg).startswith("failed (exitcode: ")


# worker exit codes that mean "stopped on purpose; rank 0 printed the reason": a guard (3, see
# train.lifecycle) or a graceful stop after signal S (128 + S)
QUIET_EXIT_CODES = (3, 128 + signal.SIGHUP, 128 + signal.SIGINT, 128 + signal.SIGTERM)


_STOPPED_BY_AGENT = (-signal.SIGTERM, 128 + signal.SIGTERM)  # what the agent's SIGTERM leaves

# exit codes after which a restart would only repeat the failure: 2 (a user error) and the quiet ones
NO_RESTART_EXIT_CODES = (2, *QUIET_EXIT_CODES)


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


def first_failure(failures: dict) -> int:
    """The global rank that failed first among ``failures`` (see :func:`describe_failures`)."""
    culprits = {r: f for r, f in failures.items() if f.exitcode not in _STOPPED_BY_AGENT} or failures
    t0 = min(getattr(f, "timestamp", 0) for f in culprits.values())
    # a kill by a signal goes first only within torch elastic's 1 s timestamp resolution of the
    # earliest failure: one seconds later is the agent's SIGKILL of a worker that ignored its SIGTERM
    # (a stopped or hung worker, 30 s after a peer failed)
    return min(culprits, key=lambda r: (not (_killed_by_signal(culprits[r].exitcode)
                                             and getattr(culprits[r], "timestamp", 0) <= t0 + 1),
                                        getattr(culprits[r], "timestamp", 0), r))


def describe_first_failure(failures: dict) -> str:
    """``"worker R died (killed by SIGKILL: ...)"`` or ``"worker R failed (exit code C)"`` for the
    worker that failed first (``failures`` must not be empty)."""
    first = first_failure(failures)
    code = failures[first].exitcode
    return f"worker {first} {'died' if _killed_by_signal(code) else 'failed'} ({_exit_text(code)})"


def describe_failures(failures: dict) -> str:
    """One line naming the worker that failed FIRST (``failures``: global rank -> torch elastic
    ProcessFailure, with ``exitcode`` and ``timestamp``). Workers that the agent stopped with SIGTERM
    after another failed are victims, not culprits: the culprit is the earliest failure (then the
    lowest rank) among those that did not end by SIGTERM; only if every worker did is it the earliest.
    A worker killed by a signal (kill -9, out of memory) comes before workers that exited with a code:
    its peers then fail their next collective (connection reset, exit 1) within the same second, and
    torch elastic's timestamps have one-second resolution. A kill more than a second after the
    earliest failure is ordered by time (the agent SIGKILLs a hung worker 30 s after a peer failed)."""
    if not failures:
        return "a worker failed; the other workers were stopped. See the messages above."
    culprits = {r: f for r, f in failures.items() if f.exitcode not in _STOPPED_BY_AGENT} or failures
    first = first_failure(failures)
    others = sorted(r for r in failures if r != first)
    line = f"worker {first} failed first ({_exit_text(failures[first].exitcode)})"
    if len(culprits) > 1:
        line += f"; also failed: {sorted(r for r in culprits if r != first)}"
    victims = [r for r in others if r not in culprits]
    if victims:
        line += f"; the agent then stopped worker(s) {victims}"
    return line + ". See its messages above."


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


launched = False  # this process ran launch(): the zerotron command skips its last collections (cli.main)


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


def max_local_nproc() -> int:
    """The most worker processes :func:`launch` starts on one machine: 8 per CPU core, at least 64."""
    return max(64, 8 * (os.cpu_count() or 1))


def launch(nproc: int, argv: list[str], module: str = "zerotron", shutdown_timeout_s: float = 30,
           max_restarts: int = 0, on_restart=None, startup_stop: str | None = None) -> int:
    """Run ``python -m <module> <argv>`` in ``nproc`` local worker processes; return an exit code.

    ``argv`` must not contain ``--nproc`` (the workers would launch again). Uses
    ``torch.distributed.run`` with ``--standalone`` (a free local rendezvous port) and
    ``--max-restarts max_restarts``: after a worker dies the agent stops the others and starts
    all ``nproc`` again, up to that many times (``on_restart``: see :func:`restart_hooks`; the
    survivors of a failed attempt find why they are stopped in :data:`RESTART_NOTE_ENV`'s file). A
    SIGTERM/SIGHUP/SIGINT to this process is forwarded to the workers by the elastic agent, which
    waits ``shutdown_timeout_s`` seconds for them before SIGKILL; then this prints one line and
    returns 128 + the signal; with ``startup_stop`` and no worker past its start-up (:func:`mark_started`),
    the line is ``zerotron: <SIGNAL> <startup_stop>``, the only line of such a stop (a training run's
    workers die by a stop signal during their start-up, without a word: ``train.stop``). A signal
    that comes while the workers are being started waits until all are (:func:`whole_spawns`), so
    none is left running. A worker that failed first with exit code 2 (a user error: it printed
    its one line) makes this return 2 without a line of its own. The workers start with glibc's heap thresholds of
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
        if startup_stop and not (Path(error_dir) / _STARTED).exists():
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


def _resolve(host: str) -> list[str]:

    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def _is_loopback(addrs: list[str]) -> bool:

    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _bindable(addr: str) -> bool:
    """True when ``addr`` belongs to this host (a socket can bind to it)."""

    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _refused(host: str, port: int) -> bool:

    try:
        socket.create_connection((host, port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def check_multinode_addresses(backend: str, env=None) -> tuple[list[str], bool]:
    """Problems of a multi-node torchrun worker's addresses, as ``(lines, certain)``; ``([], False)``
    outside torchrun or on one node (``GROUP_WORLD_SIZE`` <= 1, or all ranks local).

    A line for: MASTER_ADDR resolving to a loopback address (torchrun without ``--local-addr`` sets
    it to the hostname, which /etc/hosts often maps to 127.0.0.1: ranks on other nodes cannot reach
    it), and, for gloo without ``GLOO_SOCKET_IFNAME``, this host's name resolving to loopback (gloo
    then binds to 127.0.0.1 and tells its peers that address). ``certain`` is True when the run
    cannot work: nothing on this host listens at a loopback MASTER_ADDR:MASTER_PORT although the
    agent's store is already up (``TORCHELASTIC_USE_AGENT_STORE``), or gloo would advertise loopback
    while MASTER_ADDR is another host's address."""

    env = os.environ if env is None else env
    world, local = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))
    if "MASTER_ADDR" not in env or int(env.get("GROUP_WORLD_SIZE", 1)) <= 1 or world <= local:
        return [], False
    nodes = int(env.get("GROUP_WORLD_SIZE", 1))
    master, port = env["MASTER_ADDR"], int(env.get("MASTER_PORT", 0) or 0)
    where = f"a {nodes}-node run ({world} ranks)"
    lines, certain = [], False
    maddrs = _resolve(master)
    if _is_loopback(maddrs):
        lines.append(f"{where} has MASTER_ADDR={master}, which resolves to {maddrs[0]} (loopback): ranks on "
                     "other nodes cannot reach it; pass torchrun --local-addr <this node's address> on every "
                     "node (and --rdzv-conf is_host=1 on the rendezvous host)")
        certain = (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("GROUP_RANK", "0") != "0"
                   and port > 0 and _refused(master, port))
    if backend == "gloo" and not env.get("GLOO_SOCKET_IFNAME"):
        host = socket.gethostname()
        haddrs = _resolve(host)
        if _is_loopback(haddrs):
            lines.append(f"{where} on gloo without GLOO_SOCKET_IFNAME: this host's name {host!r} resolves to "
                         f"{haddrs[0]} (loopback), so gloo would give its peers that address; set "
                         "GLOO_SOCKET_IFNAME=<the interface that reaches the other nodes> (see 'ip -br addr')")
            certain = certain or (bool(maddrs) and not _is_loopback(maddrs) and not any(map(_bindable, maddrs)))
    return lines, certain
