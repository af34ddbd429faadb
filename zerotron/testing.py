"""Test helpers: run a function on N local ranks (gloo), build small configs, compare parameters.

``run_ranks(fn, world_size, *args)`` runs ``fn(*args)`` on ``world_size`` processes, each with a
fresh gloo process group with a short timeout, ends each rank with ``mesh.teardown()`` (as every
entry point does) and returns the list of per-rank results (index = rank). Any rank's exception is
re-raised in the caller with its traceback. ``fn`` must be importable (module level).

``run_ranks`` spawns its ranks (see the comment there: forked ranks once died of heap corruption in
an FSDP2 gather) and keeps them as a pool for the next calls (:mod:`zerotron.testing_pool`), so a
pytest session imports torch in a few rank processes (new ones only after a failed call or a
retired rank) instead of once per rank per call. The ``zerotron`` command as a child process
(``run_cli``, ``start_serve``): :mod:`zerotron.testing_cli`."""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

from .config import load_config
from .testing_pool import free_port, pool_log, run_job, run_pooled, take_caller_io

ROOT = Path(__file__).resolve().parent.parent


def _worker(rank, world_size, port, timeout_s, fn, args, queue, env=None, stdio=(), started=None):
    take_caller_io(env, stdio)  # the caller's environment (as a spawned rank would see it); stdio () = inherited
    try:
        if started is not None:  # every rank done with its imports before any enters the rendezvous (see testing_pool._pool)
            import torch  # noqa: F401

            from .distributed import mesh  # noqa: F401

            started.wait()
    except BaseException:  # noqa: BLE001 - a peer that never came (threading.BrokenBarrierError)
        queue.put((rank, "error", traceback.format_exc()))
        return
    status, payload = run_job(rank, world_size, port, timeout_s, fn, args)
    queue.put((rank, status, payload))


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0, join_timeout_s: float = 600.0,
              fresh: bool = False) -> list:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return ``[result_rank0, ...]``.

    The ranks are spawned processes (never forked: see the comment below). By default they are
    *pooled*: the processes of one call serve the next calls of this pytest process (each call pays
    the ~3-6 s of importing torch and the training stack only the first time), with a fresh process
    group, the caller's environment, working directory, stdout and stderr, and torch's default RNG
    seed each time (:func:`zerotron.testing_pool._pool_main`); a call in which any rank fails or times out ends all its
    ranks, so no rank that saw an error is reused (pooled ranks beyond its world size stay; a rank
    that retires is replaced alone, see :data:`zerotron.testing_pool._POOL_MAX_THREADS`). ``fresh=True``
    spawns new processes for this call alone, for a test about process state (one that replaces module functions in its ranks, say);
    the environment variable ``ZEROTRON_TEST_POOL=0`` makes every call fresh.

    ``timeout_s`` is the collective timeout inside the ranks; ``join_timeout_s`` bounds the wait for
    each rank's answer. Raises RuntimeError with the failing ranks' tracebacks, or on timeout."""
    # spawned, not forked from the preloaded server: two CI runs saw a rank die of heap corruption
    # ("malloc(): unaligned tcache chunk") in an FSDP2 state-dict gather with forked ranks, never
    # with spawned ones; until that is understood, ranks pay their imports once per pool
    for attempt in range(3):  # free_port's port can be taken before rank 0 listens on it (busy machine)
        try:
            if not fresh and os.environ.get("ZEROTRON_TEST_POOL", "1") != "0":
                return run_pooled(fn, world_size, args, timeout_s, join_timeout_s)
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
    pool_log(f"fresh {world_size}")
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
    messages, signals and ``--max-restarts`` need :func:`~zerotron.testing_cli.run_cli` with ``--nproc``). Raises
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
