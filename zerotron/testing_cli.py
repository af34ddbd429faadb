"""The ``zerotron`` command as a child process of a test: :func:`run_cli` forks its CLI children from
a *fork server* (``multiprocessing``'s "forkserver" start method) that imported torch and the
training stack once (:data:`PRELOAD`): a fresh interpreter spends ~3-6 s importing torch and
zerotron before its first line. The fork server is a clean process (no process group, no threads of
ours, started by exec); the caller's environment (``os.environ`` at the call) and its stdout/stderr
are handed over explicitly. :func:`start_serve` / :func:`stop_serve` run ``zerotron serve`` as a
subprocess and stop it with every process under it (:func:`process_tree`)."""
from __future__ import annotations

import os
from multiprocessing import reduction
from pathlib import Path

import torch.multiprocessing as mp

from .testing import ROOT
from .testing_pool import take_caller_io

# modules the fork server imports once for every rank it forks (an import that fails is skipped)
PRELOAD = ["torch", "torch.distributed", "numpy", "zerotron.train.trainer", "zerotron.parallel.pipeline.torch_backend",
           "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "zerotron.parity",
           "zerotron.inference.engine", "zerotron.inference.continuous", "zerotron.generate", "zerotron.testing",
           "zerotron.testing_cli", "torch.distributed.run", "zerotron.cli.train", "zerotron.cli.generate",
           "zerotron.cli.export", "zerotron.analysis.memory_cli", "zerotron.analysis.plan_cli",
           "zerotron.analysis.schedule_plot"]


def _context():
    """The "forkserver" multiprocessing context with :data:`PRELOAD` (the server starts on first use
    and lives as long as this process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Fd:
    """A file descriptor of the caller handed to a rank (pickled as a duplicate, like a Queue's pipe)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _fd_detach, (reduction.DupFd(self.fd),)


def _fd_detach(dup) -> int:
    return dup.detach()


def _cli_child(argv, cwd, env, stdio, script=None):
    take_caller_io(env, stdio)  # the caller's environment, as a fresh ``python -m zerotron`` would see it
    os.chdir(cwd)
    import sys

    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():  # read by a fresh interpreter when torch loads
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    import runpy

    from .launch_fork import exit_code_of

    if script is not None:  # ``python script.py``
        sys.argv = [script]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        code = exit_code_of(lambda: runpy.run_path(script, run_name="__main__"))
    else:  # exactly what `python -m zerotron` runs: zerotron/__main__.py, sys.exit(main())
        sys.argv = ["-m", *argv]  # runpy sets sys.argv[0] to __main__.py's path, as -m does
        code = exit_code_of(lambda: runpy.run_module("zerotron", run_name="__main__", alter_sys=True))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no multiprocessing epilogue: the exit code is the command's


def run_cli(argv: list[str], cwd: str | Path | None = None, env: dict | None = None, timeout: float = 300,
            script: str | Path | None = None):
    """``python -m zerotron <argv>`` (or ``python <script>``) as a child process forked from the fork
    server (:data:`PRELOAD`: torch and the CLI already imported, ~2-3 s less per command than a fresh
    interpreter), in ``cwd`` with the environment ``env`` (default: this process's), stdout and
    stderr captured. The child is a real process running the real entry point
    (``zerotron.cli.main``), so exit codes, files and ``--nproc`` launches behave as from a shell;
    use :mod:`subprocess` where the test is about the interpreter itself (signals to a fresh process,
    import side effects). Returns a ``subprocess.CompletedProcess`` (``args``, ``returncode``,
    ``stdout``, ``stderr`` as text); raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds
    (the child is killed)."""
    import subprocess
    import tempfile

    ctx = _context()
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = ctx.Process(target=_cli_child, args=(list(argv), cwd, env, (_Fd(out.fileno()), _Fd(err.fileno())),
                                                 None if script is None else str(script)), daemon=False)
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(["zerotron", *argv], timeout)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess(["zerotron", *argv] if script is None else ["python", str(script)],
                                       p.exitcode, texts[0], texts[1])


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first (from the parent links in ``/proc``). The
    workers of ``--nproc`` run in sessions of their own (torch's elastic agent), so a process
    group does not hold them; a walk of the tree does."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:  # it ended
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop(0))
        todo.extend(children.get(out[-1], []))
    return out


def stop_serve(proc, timeout_s: float = 60.0, signal_first: bool = True) -> int:
    """Stop a server started by :func:`start_serve` (or any subprocess) and every process under it:
    SIGTERM to it (unless not ``signal_first``), up to ``timeout_s`` seconds to exit, then SIGKILL to
    whatever is left of the tree as it was before (launcher, workers, HTTP front end). Returns
    its exit code (-9 when killed)."""
    import signal
    import subprocess

    tree = process_tree(proc.pid) if proc.poll() is None else []
    try:
        if signal_first and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # ended already
                pass
    return proc.wait()


def start_serve(checkpoint, *extra: str, timeout_s: float = 300.0):
    """Start ``zerotron serve --checkpoint CHECKPOINT --port 0 EXTRA...`` as a subprocess (one torch
    thread per process) and wait until it prints its "listening on" line. Returns ``(process, its
    output lines so far and to come (a list a reader thread keeps appending to), base URL)``.
    Raises AssertionError with the output if the server exits or does not listen within
    ``timeout_s`` seconds (the process and all its descendants are killed: :func:`stop_serve`); the
    default leaves room for a loaded 2-core machine (120 s was too short for ``--nproc 2`` with the
    front-end process beside 3 busy loops and other jobs, load average ~25).
    Stop it with :func:`stop_serve` in a ``finally``, so a failed test leaves no worker running."""
    import re
    import subprocess
    import sys
    import threading
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "zerotron", "serve", "--checkpoint", str(checkpoint), "--port", "0",
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True).start()
    deadline = time.time() + timeout_s
    while not any("listening on" in ln for ln in lines):
        if proc.poll() is not None or time.time() > deadline:
            stop_serve(proc, signal_first=False)
            raise AssertionError("".join(lines))
        time.sleep(0.2)
    return proc, lines, re.search(r"listening on (http://\S+)", "".join(lines)).group(1)
