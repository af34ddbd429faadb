"""Opt-in: the ``--nproc`` launcher starts its workers by ``fork`` instead of ``exec`` (tests).

A fresh worker interpreter spends ~3 CPU s importing torch, ``torch._dynamo`` and the training stack
before its first line (``benchmarks/suite_imports_s7.md``). A launcher that already imported them
(the test fork server's ``run_cli`` children, :data:`zerotron.testing_cli.PRELOAD`) can hand each worker
those imports by forking. With :data:`ENV` = ``1`` in the launcher's environment,
:func:`fork_workers` makes torch elastic's ``SubprocessHandler`` fork the worker in place of
``Popen([python, "-u", "-m", <module>, ...])``; everything else in torch elastic is unchanged, so

- failures are reported exactly as for exec'd workers: the same ``SubprocessContext`` polls each
  worker's exit code (``ProcessFailure`` per worker, with its time) — unlike elastic's function
  entrypoints (``MultiprocessContext``), which report only the first failure by index;
- parentage is unchanged: the worker is a child of the launcher, in a session of its own
  (``start_new_session``: the agent's ``killpg`` reaches it), and ``die_with_parent`` still ties it
  to the launcher.

The fork child is made to look like the exec'd interpreter it replaces (:func:`_become_worker`):
its own session; stdout/stderr as Popen would set them, unbuffered (``-u``); every other inherited
descriptor pointed at ``/dev/null`` (``close_fds``: the launcher's run-directory flock, the agent's
TCPStore sockets — replaced rather than closed, so a stale Python object of the launcher closing its
descriptor later cannot close one the worker opened under the same number); the environment Popen
would pass; default signal dispositions as a fresh interpreter has them (the agent's SIGTERM/SIGINT
handlers dropped); the launcher's ``atexit`` handlers dropped (the worker's own run at its exit);
glibc's heap thresholds from the environment (:func:`zerotron.host_heap.apply_env`, which an exec'd
interpreter's glibc reads at start) and ``OMP_NUM_THREADS``; torch's default dtype and grad mode as at
import, and torch's, numpy's and Python's global RNGs seeded anew, as each fresh interpreter seeds
them (non-deterministically). What a fork cannot give: ``/proc/PID/environ`` and ``/proc/PID/cmdline`` of the worker (they show
the launcher's, as the kernel recorded them at its exec: find a worker's rank another way), a new
``PYTHONHASHSEED`` per worker (the
workers share the launcher's string hashing, so a rank-dependent set order would go unseen), a
fresh logging/warnings configuration (the launcher's is inherited), and a process free of the
launcher's threads' locks: only the forking thread exists in the child, so a lock another thread
of the launcher held at the fork stays held there. The launcher's other threads at that moment are
torch elastic's (the rendezvous TCPStore server), whose state the worker never touches; the
launcher itself has no process group and, with one intra-op thread, no OpenMP pool.

Not for production launches: a plain ``zerotron train --nproc N`` imports little in the launcher
(so a fork would save little), and a fresh interpreter per worker is the tested, conventional path.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import traceback

ENV = "ZEROTRON_FORK_WORKERS"
"""``1``: :func:`zerotron.launch.launch` forks its workers (see the module); anything else: exec."""

PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint", "zerotron.train.trainer")
"""what a worker of ``zerotron train`` imports (optimizer -> dynamo, DCP, the engine): imported once
by the launcher (:func:`preload`) instead of once per worker"""


def wanted(env=None) -> bool:
    """Whether to fork: :data:`ENV` asks for it in ``env`` (default ``os.environ``) and this process
    has no default process group (a fork would copy it into the worker, whose own
    ``init_process_group`` would then fail: a test's process that launches in-process after a
    single-process run, say); otherwise workers are exec'd."""
    if (os.environ if env is None else env).get(ENV, "") != "1":
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


class _ForkedPopen(subprocess.Popen):
    """``subprocess.Popen`` whose child is a fork of this process running ``python -m <module>
    <argv>`` in place (:func:`_become_worker`) instead of an exec; every other method (``poll``,
    ``wait``, ``send_signal``, ``returncode``) is Popen's own, on the child's pid."""

    def __init__(self, argv: list[str], **kwargs):
        self._worker_argv = argv
        super().__init__(**kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        sys.stdout.flush()  # no buffered launcher output copied into the child
        sys.stderr.flush()
        stdio = (c2pwrite if c2pwrite != -1 else None, errwrite if errwrite != -1 else None)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the launcher's stack
            code = 1
            try:
                os.close(ready_r)
                if start_new_session:
                    os.setsid()
                os.close(ready_w)  # its session exists: the launcher may now signal it (killpg)
                code = _become_worker(self._worker_argv, dict(os.environ if env is None else env), stdio, False)
            finally:
                os._exit(code)
        os.close(ready_w)
        try:  # as Popen returns once its child is set up: the agent's killpg(pid) found no group while
            os.read(ready_r, 1)  # the fork had not yet made its session (ProcessLookupError, a stop at spawn)
        finally:
            os.close(ready_r)
        self.pid = pid
        self._child_created = True


def _dev_null_over_inherited(keep: tuple[int, ...] = (0, 1, 2)) -> None:
    """Point every open descriptor but ``keep`` at ``/dev/null`` (what ``close_fds`` gives an
    exec'd child, without freeing the numbers: see the module)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep and fd != null:
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:  # the listing's own descriptor, already closed
                    pass
    finally:
        os.close(null)


def _default_signals() -> None:
    """Signal dispositions as exec gives them and CPython then sets them: a caught signal back to
    its default, an ignored one still ignored (exec keeps SIG_IGN), SIGINT to Python's
    ``KeyboardInterrupt`` handler unless ignored, SIGPIPE and SIGXFSZ ignored."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if signal.getsignal(sig) != signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _become_worker(argv: list[str], env: dict, stdio: tuple, new_session: bool) -> int:
    """Body of a forked worker: turn this fork into the exec'd worker it replaces (see the module),
    run ``python -m <argv>`` (``argv[0]`` the module) and return its exit code."""
    import atexit
    import io
    import runpy

    if new_session:
        os.setsid()
    for fd, target in zip(stdio, (1, 2)):
        if fd is not None:
            os.dup2(fd, target)
    _dev_null_over_inherited()
    _default_signals()
    atexit._clear()  # the launcher's handlers are not the worker's
    os.environ.clear()
    os.environ.update(env)
    # ``python -u``: unbuffered stdout and stderr
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                  encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  encoding=sys.stderr.encoding, errors="backslashreplace")
    from . import host_heap

    host_heap.apply_env(env)
    if "torch" in sys.modules:
        import torch

        if env.get("OMP_NUM_THREADS", "").isdigit():  # read by a fresh interpreter when torch loads
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.seed()  # a fresh interpreter's default generator starts from a non-deterministic seed
    if "numpy" in sys.modules:  # so does numpy's global one (Python's random re-seeds itself after a fork)
        import numpy

        numpy.random.seed()
    sys.argv = ["-m", *argv[1:]]  # runpy sets sys.argv[0] to the module's path, as -m does
    code = exit_code_of(lambda: runpy.run_module(argv[0], run_name="__main__", alter_sys=True))
    try:
        atexit._run_exitfuncs()  # the worker's own, as at an interpreter's exit
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    return code


def exit_code_of(main) -> int:
    """Run ``main()`` (a main module's body) and return the exit code an interpreter would give for it: 0 when
    it returns; a ``SystemExit``'s code (None -> 0; a non-int code is printed to stderr and gives 1); 1 with
    the traceback printed for any other exception, as for an uncaught one."""
    try:
        main()
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        return 1


def preload() -> None:
    """Import :data:`PRELOAD` in this process (the launcher, before torch elastic's agent starts its
    threads), so that forked workers find them imported; a module that fails to import is left to
    the worker (which reports the error as an exec'd one would)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker's own import reports it
            pass


def _module_argv(args: tuple) -> list[str] | None:
    """``[module, *argv]`` when ``args`` is ``(sys.executable, "-u", "-m", module, *argv)`` (what
    ``torch.distributed.run`` starts for ``-m module``), else None (exec as usual)."""
    if len(args) >= 4 and args[0] == sys.executable and args[1] == "-u" and args[2] == "-m":
        return [str(a) for a in args[3:]]
    return None


@contextlib.contextmanager
def fork_workers(enabled: bool):
    """While the block runs and ``enabled``, torch elastic's ``SubprocessHandler._popen`` (torch
    2.x private API) forks ``python -u -m <module> ...`` workers (:class:`_ForkedPopen`) instead of
    exec'ing them; other commands are exec'd as before."""
    if not enabled:
        yield
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    popen = SubprocessHandler._popen

    def _popen(self, args, env):
        argv = _module_argv(tuple(args))
        if argv is None:
            return popen(self, args, env)
        return _ForkedPopen(argv, args=list(args), env=env, stdout=self._stdout, stderr=self._stderr,
                            start_new_session=True)

    SubprocessHandler._popen = _popen
    try:
        yield
    finally:
        SubprocessHandler._popen = popen
