"""Test helpers: run a function on N local ranks (gloo) and build small configs.

``run_ranks(fn, world_size, *args)`` runs ``fn(*args)`` on ``world_size`` processes, each with a
fresh gloo process group with a short timeout, ends each rank with ``mesh.teardown()`` (as every
entry point does) and returns the list of per-rank results (index = rank). Any rank's exception is
re-raised in the caller with its traceback. ``fn`` must be importable (module level).

``run_ranks`` spawns its ranks (see the comment there: forked ranks once died of heap corruption in
an FSDP2 gather) and keeps them as a pool for the next calls, so a pytest session imports torch in
a few rank processes (new ones only after a failed call or a retired rank) instead of once per rank
per call. ``run_cli`` forks its CLI children from a *fork server* (``multiprocessing``'s
"forkserver" start method) that imported torch and the training stack once (:data:`PRELOAD`): a
fresh interpreter spends ~3-6 s importing torch and zerotron before its first line. The fork server
is a clean process (no process group, no threads of ours, started by exec); the caller's
environment (``os.environ`` at the call) and its stdout/stderr are handed over explicitly."""
from __future__ import annotations

import os
import socket
import traceback
from multiprocessing import reduction
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

from .config import load_config

ROOT = Path(__file__).resolve().parent.parent
# modules the fork server imports once for every rank it forks (an import that fails is skipped)
PRELOAD = ["torch", "torch.distributed", "numpy", "zerotron.train.trainer", "zerotron.parallel.pipeline.torch_backend",
           "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "zerotron.parity",
           "zerotron.inference.engine", "zerotron.inference.continuous", "zerotron.generate", "zerotron.testing",
           "torch.distributed.run", "zerotron.cli.train", "zerotron.cli.generate", "zerotron.cli.export",
           "zerotron.analysis.memory_cli", "zerotron.analysis.plan_cli", "zerotron.analysis.schedule_plot"]


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(rank, world_size, port, timeout_s, fn, args) -> tuple[str, object]:
    """One rank's part of a run_ranks call in this process: ``("ok", result)`` or ``("error", traceback)``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        from .distributed import mesh

        mesh.init_distributed("gloo", timeout_s=timeout_s)
        result = fn(*args)
        mesh.teardown()  # as every entry point ends: pending async work, barrier, then destroy
        return "ok", result
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return "error", traceback.format_exc()


def _worker(rank, world_size, port, timeout_s, fn, args, queue, env=None, stdio=(), started=None):
    if env is not None:  # the caller's environment, not the fork server's (as a spawned rank would see it)
        os.environ.clear()
        os.environ.update(env)
    for fd, target in zip(stdio, (1, 2)):  # the caller's stdout/stderr (pytest's capture of this test)
        os.dup2(fd, target)
        os.close(fd)
    try:
        if started is not None:  # every rank done with its imports before any enters the rendezvous (see _pool)
            import torch  # noqa: F401

            from .distributed import mesh  # noqa: F401

            started.wait()
    except BaseException:  # noqa: BLE001 - a peer that never came (threading.BrokenBarrierError)
        queue.put((rank, "error", traceback.format_exc()))
        return
    status, payload = _run_job(rank, world_size, port, timeout_s, fn, args)
    queue.put((rank, status, payload))


def _pool_main(conn) -> None:
    """Body of a pooled rank (see :func:`run_ranks`): run one job per message
    ``(rank, world_size, port, timeout_s, fn, args, env, cwd)`` followed by the caller's stdout and
    stderr descriptors, answer ``(status, payload, retire, collected)``; exit on ``None``, a closed pipe, a
    failed job or ``retire`` (the number of threads left when more than :data:`_POOL_MAX_THREADS`, else 0);
    ``collected`` is ``(threads before, after)`` when the threads left exceeded the idle count and one
    collection of everything, frozen objects included, ran (for the pool log), else None. Between jobs the process is put back as a fresh one would start the next: the caller's
    environment and working directory, torch's default RNG seed, default dtype and grad mode, no
    process group (the job's teardown destroyed it, with DTensor's caches), comm counters at zero,
    warnings shown again."""
    import gc
    import sys
    import warnings

    import torch

    from .distributed import comm, inflight, mesh  # noqa: F401 - mesh: imported here, not in the first job

    try:  # its functions take the default group of the moment they are imported as a default argument:
        import torch.distributed.nn.functional  # noqa: F401 - imported in a job, that job's world would live on
    except ImportError:
        pass

    seed, dtype = torch.initial_seed(), torch.get_default_dtype()
    home, own = os.getcwd(), (os.dup(1), os.dup(2))
    idle = _thread_count()  # threads of a rank between jobs (no process group)
    conn.send("ready")  # imports done: the caller sends no job before every rank of it says so (_pool)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        rank, world_size, port, timeout_s, fn, args, env, cwd = msg
        stdio = [reduction.recv_handle(conn) for _ in range(2)]
        os.environ.clear()
        os.environ.update(env)
        for fd, target in zip(stdio, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(True)
        comm.STATS.reset()
        warnings._filters_mutated()  # "default"/"once" warnings of earlier jobs are shown again
        try:
            os.chdir(cwd)
            status, payload = _run_job(rank, world_size, port, timeout_s, fn, args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, target in zip(own, (1, 2)):
                os.dup2(fd, target)
            os.chdir(home)
        if status == "ok" and inflight.in_flight():
            status, payload = "error", f"async collectives left in flight: {inflight.in_flight()}"
        gc.collect()  # the job's objects in reference cycles may hold process groups (and their threads)
        threads, collected = _thread_count(), None
        if threads > idle:
            # objects frozen earlier (by the gc.freeze below, or by a job between its parts: parity's
            # run_many after each layout) are never collected while frozen, even once they are garbage:
            # a job's kept DeviceMeshes (reference cycles) keep their destroyed gloo groups and threads
            # alive. One collection of everything (0.15-0.4 s) frees them; a respawn costs ~3-6 s
            gc.unfreeze()
            gc.collect()
            collected = (threads, _thread_count())
            threads = collected[1]
        gc.freeze()  # the survivors (imports, caches: ~300k objects) are left out of later collections, each of
        # which would otherwise walk them all (0.15-0.4 s per collection and rank)
        retire = threads if threads > _POOL_MAX_THREADS else 0  # the count, for the pool log
        try:
            try:
                conn.send((status, payload, retire, collected))
            except (BrokenPipeError, ConnectionResetError):  # the caller ended the pool (another rank failed)
                return
            except Exception:  # noqa: BLE001 - an unpicklable result: report it (the job is not reused either)
                conn.send(("error", traceback.format_exc(), 0, None))  # (status, payload, retire, collected) as always
                return
        except OSError:
            return
        if status != "ok" or retire:
            return


def _thread_count() -> int:
    """Threads of this process (0 where /proc is not there)."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


# a pooled rank retires after a job that leaves it more threads than this, even after a full
# collection (see _pool_main): something still holds destroyed gloo groups (three threads each, one
# of them waking every 10 ms); a fresh process costs less than hundreds of such threads
_POOL_MAX_THREADS = 48
_POOL: list = []  # [(process, connection) or None (ended, spawned again when needed)] of pooled ranks, index = rank
_EXIT: list = []  # _stop_pool once registered with atexit


def _pool_log(event: str) -> None:
    """One line per pool event (a rank spawned, ranks ended and why) appended to the file named by
    ``ZEROTRON_TEST_POOL_LOG``, if set: how often a test session pays a rank's imports
    (``benchmarks/suite_durations.md``)."""
    path = os.environ.get("ZEROTRON_TEST_POOL_LOG")
    if path:
        import time

        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            f.write(f"{time.time():.2f} {event} {test}\n")


def _end_ranks(indices, why: str) -> None:
    """End the pooled ranks at ``indices`` (they exit on the closed pipe; killed if they do not
    within 5 s); their slots are spawned again by the next call that needs them."""
    ended = [(i, _POOL[i]) for i in indices if i < len(_POOL) and _POOL[i] is not None]
    if not ended:
        return
    _pool_log(f"end {len(ended)} {why}")
    for i, (_, conn) in ended:
        conn.close()
        _POOL[i] = None
    for _, (p, _) in ended:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _stop_pool(why: str = "exit") -> None:
    """End every pooled rank (at exit)."""
    _end_ranks(range(len(_POOL)), why)
    _POOL.clear()


def _pool(world_size: int, ready_timeout_s: float) -> list:
    """The first ``world_size`` pooled ranks, spawning the missing ones (a rank that died between
    calls is replaced), each done with its imports.

    A job's rendezvous (``init_process_group``) is bounded by the job's collective timeout, which
    tests set to a few seconds; a rank spawned for this call (its slot was empty: a world larger
    than before, a failed call, a retired rank) spends seconds importing torch (8.8 s wall measured
    at load 34) while the pooled ones would already wait in the rendezvous. So the new ranks' "ready" is
    awaited here (at most ``ready_timeout_s``) and the job goes to all of them at once."""
    import atexit
    from multiprocessing.connection import wait

    _end_ranks([i for i, e in enumerate(_POOL) if e is not None and not e[0].is_alive()], "dead")
    if _stop_pool not in _EXIT:
        atexit.register(_stop_pool)  # runs before multiprocessing's exit handler joins its children
        _EXIT.append(_stop_pool)
    ctx = mp.get_context("spawn")
    _POOL.extend([None] * (world_size - len(_POOL)))
    new = {}
    for i in range(world_size):
        if _POOL[i] is None:
            parent, child = ctx.Pipe(duplex=True)  # a socket pair: descriptors travel over it
            p = ctx.Process(target=_pool_main, args=(child,), daemon=False)
            p.start()
            child.close()
            _POOL[i] = (p, parent)
            new[parent] = i
            _pool_log(f"spawn {i}")
    starting = dict(new)
    while starting:
        ready = wait(list(starting), timeout=ready_timeout_s)
        for conn in ready:
            try:
                ok = conn.recv() == "ready"
            except EOFError:  # it died while importing
                ok = False
            if not ok:
                ready = []
                break
            starting.pop(conn)
        if not ready:
            i = min(starting.values())
            code = _POOL[i][0].exitcode
            _end_ranks(new.values(), "not ready")
            raise RuntimeError(f"pooled rank {i} did not start within {ready_timeout_s:g} s"
                               + (f" (exit code {code})" if code is not None else ""))
    return _POOL[:world_size]


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0, join_timeout_s: float = 600.0,
              fresh: bool = False) -> list:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return ``[result_rank0, ...]``.

    The ranks are spawned processes (never forked: see the comment below). By default they are
    *pooled*: the processes of one call serve the next calls of this pytest process (each call pays
    the ~3-6 s of importing torch and the training stack only the first time), with a fresh process
    group, the caller's environment, working directory, stdout and stderr, and torch's default RNG
    seed each time (:func:`_pool_main`); a call in which any rank fails or times out ends all its
    ranks, so no rank that saw an error is reused (pooled ranks beyond its world size stay; a rank
    that retires is replaced alone, see :data:`_POOL_MAX_THREADS`). ``fresh=True`` spawns new processes for this call
    alone, for a test about process state (one that replaces module functions in its ranks, say);
    the environment variable ``ZEROTRON_TEST_POOL=0`` makes every call fresh.

    ``timeout_s`` is the collective timeout inside the ranks; ``join_timeout_s`` bounds the wait for
    each rank's answer. Raises RuntimeError with the failing ranks' tracebacks, or on timeout."""
    # spawned, not forked from the preloaded server: two CI runs saw a rank die of heap corruption
    # ("malloc(): unaligned tcache chunk") in an FSDP2 state-dict gather with forked ranks, never
    # with spawned ones; until that is understood, ranks pay their imports once per pool
    for attempt in range(3):  # free_port's port can be taken before rank 0 listens on it (busy machine)
        try:
            if not fresh and os.environ.get("ZEROTRON_TEST_POOL", "1") != "0":
                return _run_pooled(fn, world_size, args, timeout_s, join_timeout_s)
            return _run_fresh(fn, world_size, args, timeout_s, join_timeout_s)
        except RuntimeError as e:  # the store never came up, so fn did not run: try another port
            if attempt == 2 or "EADDRINUSE" not in str(e):
                raise


def _run_fresh(fn, world_size: int, args: tuple, timeout_s: float, join_timeout_s: float) -> list:
    """run_ranks on newly spawned ranks (see there)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    started = ctx.Barrier(world_size, timeout=join_timeout_s)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, fn, args, queue, env,
                                               (), started), daemon=False)  # spawned ranks inherit stdout/stderr
             for r in range(world_size)]
    for p in procs:
        p.start()
    _pool_log(f"fresh {world_size}")
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=join_timeout_s)
            (results if status == "ok" else errors)[rank] = payload
            if errors:
                break
    except Exception as e:  # queue.Empty
        errors[-1] = f"timed out after {join_timeout_s}s waiting for ranks: {e!r}"
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _run_pooled(fn, world_size: int, args: tuple, timeout_s: float, join_timeout_s: float) -> list:
    """run_ranks on the pooled ranks (see there)."""
    from multiprocessing.connection import wait

    ranks = _pool(world_size, join_timeout_s)
    port, env, cwd = free_port(), dict(os.environ), os.getcwd()
    results, errors, retired = {}, {}, []
    try:
        for r, (p, conn) in enumerate(ranks):
            conn.send((r, world_size, port, timeout_s, fn, args, env, cwd))
            for fd in (1, 2):  # the caller's stdout/stderr now (pytest's capture of this test)
                reduction.send_handle(conn, fd, p.pid)
        waiting = {conn: r for r, (_, conn) in enumerate(ranks)}
        while waiting and not errors:
            ready = wait(list(waiting), timeout=join_timeout_s)
            if not ready:
                errors[-1] = f"timed out after {join_timeout_s}s waiting for ranks {sorted(waiting.values())}"
            for conn in ready:
                r = waiting.pop(conn)
                try:
                    status, payload, retire, collected = conn.recv()
                    if retire:
                        retired.append((r, retire))
                    if collected:
                        _pool_log(f"collected rank {r}: {collected[0]} -> {collected[1]} threads")
                except EOFError:  # the rank's process ended (os._exit, a signal)
                    ranks[r][0].join(timeout=5)
                    status, payload = "error", f"rank process died (exit code {ranks[r][0].exitcode})"
                (results if status == "ok" else errors)[r] = payload
    except BaseException:
        _end_ranks(range(world_size), "interrupted")
        raise
    if errors:  # every rank of this call saw the failure (or may still hang in it): none is reused
        _end_ranks(range(world_size), "error")
    elif retired:  # these exit by themselves after answering (see _pool_main)
        _end_ranks([r for r, _ in retired], f"retired ({', '.join(f'rank {r}: {n} threads' for r, n in retired)})")
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _cli_child(argv, cwd, env, stdio, script=None):
    os.environ.clear()  # the caller's environment, as a fresh ``python -m zerotron`` would see it
    os.environ.update(env)
    for fd, target in zip(stdio, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
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


def _captured(fn, args: tuple, env: dict) -> tuple[object, str, str]:
    import contextlib
    import io

    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args)
    return result, out.getvalue(), err.getvalue()


def run_ranks_captured(fn, world_size: int, *args, env: dict | None = None, timeout_s: float = 60.0,
                       join_timeout_s: float = 600.0) -> list[tuple[object, str, str]]:
    """:func:`run_ranks` of ``fn(*args)`` with ``env`` added to each rank's environment and its
    Python-level stdout and stderr captured: ``[(result, stdout, stderr), ...]`` per rank. With
    ``fn = zerotron.cli.main.main`` and ``args = (argv,)`` (no ``--nproc``) this is ``zerotron
    <argv>`` as each worker of a ``--nproc`` launch runs it (RANK and WORLD_SIZE set, the process
    group up), on the pooled ranks instead of that many fresh interpreters (~4 CPU s each): for
    reference runs and any check that is not about the launcher itself (the launcher's lock,
    messages, signals and ``--max-restarts`` need :func:`run_cli` with ``--nproc``). Raises
    RuntimeError as :func:`run_ranks` does."""
    return run_ranks(_captured, world_size, fn, args, dict(env or {}), timeout_s=timeout_s,
                     join_timeout_s=join_timeout_s)


def tiny_config(overrides: dict | None = None, path: str | Path = ROOT / "configs" / "tiny.toml"):
    """``configs/tiny.toml`` with ``{"section.field": value}`` overrides applied (no progress bar, no
    plot, no sample)."""
    base = {"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0"}
    base.update({k: str(v) for k, v in (overrides or {}).items()})
    return load_config(path, list(base.items()))


def assert_close_normwise(a, b, rtol: float, what: str = "") -> None:
    """``||a - b|| <= rtol * ||b||`` for one tensor (numpy arrays). Element-wise rtol is not
    meaningful after Adam steps: Adam divides each gradient by its own RMS, so an entry whose
    gradient is ~0 (a rare token's row) moves by +-lr on fp32 rounding noise that differs between
    two summation orders. Raises AssertionError naming ``what``."""
    err = np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def assert_params_close(params: dict, ref: dict, rtol: float, what: str = "", subset: bool = False) -> None:
    """Every tensor of ``params`` norm-wise close to ``ref`` (dicts of numpy arrays, dense names).

    The attention *key* bias (middle third of ``attn.c_attn.bias``) is left out: its true gradient
    is zero (softmax is invariant to a shift shared by all keys of a query), so Adam turns fp32
    rounding noise into +-lr steps there. ``subset``: ``params`` may hold only some of ``ref``'s keys
    (one pipeline stage)."""
    keys_ok = set(params) <= set(ref) if subset else set(params) == set(ref)
    assert keys_ok, f"{what}: keys differ {sorted(set(params) ^ set(ref))}"
    for k, a in params.items():
        v = ref[k]
        assert a.shape == v.shape, (what, k, a.shape, v.shape)
        if k.endswith("attn.c_attn.bias"):
            c = v.shape[0] // 3
            a, v = np.concatenate([a[:c], a[2 * c:]]), np.concatenate([v[:c], v[2 * c:]])
        assert_close_normwise(a, v, rtol, f"{what} {k}")


def checkpoint_flat(ckpt_dir, out) -> dict:
    """Every value of a DCP checkpoint directory as ``{".model.transformer.wte.weight": tensor, ...}``
    (nested keys joined with "."), via torch's ``dcp_to_torch_save`` into the file ``out``. For
    bitwise comparisons of two checkpoints in tests."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt_dir), str(out))
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = obj

    walk("", torch.load(out, weights_only=False))
    return flat


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

