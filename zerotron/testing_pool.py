"""The pool of :func:`zerotron.testing.run_ranks`: spawned rank processes that serve one call after
another, so a pytest session imports torch in a few rank processes (new ones only after a failed
call or a retired rank) instead of once per rank per call.

A pooled rank (:func:`_pool_main`) runs one job per message and is put back between jobs as a fresh
process would start the next; :func:`_pool` spawns the missing ranks and awaits their imports;
:func:`run_pooled` sends a call's job to them and ends the ranks that saw an error or retired.
``ZEROTRON_TEST_POOL_LOG`` names a file that gets one line per pool event (:func:`pool_log`).
"""
from __future__ import annotations

import os
import socket
import traceback
from multiprocessing import reduction

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (the rendezvous port of a call's ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def take_caller_io(env, stdio) -> None:
    """Make this process the caller's, as a fresh process started by the caller would be: its
    environment ``env`` (None: keep this one's) and its stdout/stderr, the descriptors ``stdio``
    (duplicated onto 1 and 2, then closed; an empty tuple: keep this process's)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    for fd, target in zip(stdio, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)


def run_job(rank, world_size, port, timeout_s, fn, args) -> tuple[str, object]:
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


def _pool_main(conn) -> None:
    """Body of a pooled rank (see :func:`zerotron.testing.run_ranks`): run one job per message
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
        take_caller_io(env, [reduction.recv_handle(conn) for _ in range(2)])
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(True)
        comm.STATS.reset()
        warnings._filters_mutated()  # "default"/"once" warnings of earlier jobs are shown again
        try:
            os.chdir(cwd)
            status, payload = run_job(rank, world_size, port, timeout_s, fn, args)
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


def pool_log(event: str) -> None:
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
    pool_log(f"end {len(ended)} {why}")
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
            pool_log(f"spawn {i}")
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


def run_pooled(fn, world_size: int, args: tuple, timeout_s: float, join_timeout_s: float) -> list:
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
                        pool_log(f"collected rank {r}: {collected[0]} -> {collected[1]} threads")
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
