"""Saving a checkpoint collectively: written into ``.tmp_step_<N>``, checksummed, renamed to
``step_<N>`` by rank 0, then older checkpoints rotated (see the package docstring).

A save has two halves: :func:`stage_checkpoint` takes what the checkpoint holds out of the live
training state (the model and optimizer tensors as host copies when ``copy`` is set, the RNG
states, the scheduler state), and :func:`write_checkpoint` writes a staged state. The synchronous
:func:`save_checkpoint` runs both at once; ``background.AsyncSaver`` runs the second in a thread,
with every collective of the write on a process group of its own (``group``)."""
from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zerotron.data.tokenizer import copy_tokenizer
from zerotron.distributed.groups import NamedGroup
from zerotron.distributed.watchdog import watch
from zerotron.parallel.tensor.transform import find_rng_tracker, tracker_checkpoint_state

from .files import SET_ASIDE, CheckpointSpaceError, CheckpointWriteError, latest_checkpoint, list_checkpoints
from .integrity import META_CHECKSUM, complete_checksums, file_checksum, gather_checksums, meta_checksum, own_files
from .rng import rng_state
from .space import space_report, space_shortfall


def _named(group):
    """``group`` as the watchdog names it: a background save's own group (``background.AsyncSaver``)
    is "checkpoint" (None stays the world)."""
    return group if group is None else NamedGroup(group, "checkpoint")


def _agree_error(err: BaseException | None, group=None) -> str | None:
    """Collective over ``group`` (None: the default group, all ranks): None if no rank failed,
    else the first failing rank's one-line description. A dead or hung peer raises the watchdog's
    one-line CollectiveError (was gloo's RuntimeError, a traceback on the waiting rank)."""
    flag = torch.tensor([0.0 if err is None else 1.0], dtype=torch.float64)
    with watch("all_reduce", _named(group), "checkpoint_agree"):  # checkpoint I/O: like DCP, not through comm.py
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        return None
    descs = [None] * dist.get_world_size(group)
    mine = None if err is None else (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
    with watch("all_gather_object", _named(group), "checkpoint_agree"):
        dist.all_gather_object(descs, mine, group=group)
    return next(f"rank {r}: {d}" for r, d in enumerate(descs) if d is not None)


def _fault_write(step: int, rank: int, path: Path) -> None:
    """Fault hook for tests: ZEROTRON_FAULT_SAVE_ENOSPC_AT_STEP=N (ZEROTRON_FAULT_SAVE_RANK=r,
    default 0) makes this rank's save of step N fail as a full disk would. (ZEROTRON_FAULT_NO_SPACE_CHECK=1
    skips the free-space check before each save, as if another writer filled the disk after it.)"""
    if os.environ.get("ZEROTRON_FAULT_SAVE_ENOSPC_AT_STEP") == str(step) and \
            os.environ.get("ZEROTRON_FAULT_SAVE_RANK", "0") == str(rank):
        path.write_bytes(b"\0" * 100)  # a partial file, as a full disk leaves
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))


def _fault_slow_write(step: int) -> None:
    """Fault hook for tests: ZEROTRON_FAULT_SLOW_SAVE_S=x makes every rank's write of a checkpoint
    take ``x`` seconds longer (a slow disk), after the DCP files and before the rename, so that a
    test can signal or kill a run while a background write is pending."""
    delay = float(os.environ.get("ZEROTRON_FAULT_SLOW_SAVE_S", "0") or 0)
    if delay > 0:
        time.sleep(delay)


@dataclass
class StagedCheckpoint:
    """What one checkpoint holds, taken out of the live training state by :func:`stage_checkpoint`:
    ``state`` ({"model": ..., "optim": ...}, the dicts handed to DCP), ``rng`` (this rank's RNG
    states), ``trainer`` (scheduler state and step, written by rank 0), ``step`` and ``meta``;
    ``finish`` (a deferred stage: ``state`` is empty until the writer calls it, see
    :func:`stage_checkpoint`)."""

    step: int
    state: dict
    rng: dict
    trainer: dict
    meta: dict
    finish: object = None  # defer: callable(stand-in groups) -> (model, optim) state, run before the write


def _host_copy(obj, cache: dict | None = None, key: str = ""):
    """``obj`` with every tensor replaced by a detached copy in host memory (DTensors stay
    DTensors: their local shard is copied); other values are deep-copied. ``cache`` ({path: tensor},
    kept by the caller between saves): a plain tensor is copied into the buffer of the same path,
    shape and dtype from the previous save instead of a fresh allocation (no page faults on the
    second and later saves; the caller must know that the previous copy is no longer read)."""
    if isinstance(obj, torch.Tensor):
        if cache is None or type(obj) is not torch.Tensor:
            return obj.detach().to("cpu", copy=True)
        buf = cache.get(key)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = cache[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu",
                                           pin_memory=obj.device.type == "cuda")
        return buf.copy_(obj.detach())
    if isinstance(obj, dict):
        return {k: _host_copy(v, cache, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v, cache, f"{key}/{i}") for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def stage_checkpoint(step: int, strategy, optimizer, scheduler, meta: dict, copy_state: bool = False,
                     buffers: dict | None = None, defer: bool = False) -> StagedCheckpoint:
    """Collectively take checkpoint ``step`` out of the training state (all ranks must call; the
    strategy's ``checkpoint_state`` may gather). ``copy_state``: the model and optimizer tensors are
    copied into host memory (bytes: this rank's share of the checkpoint), so training can go on
    changing the live ones while the copy is written; without it the write must finish before the
    next optimizer step. RNG and scheduler states are always copies. ``buffers``: host buffers
    reused between saves (see :func:`_host_copy`). ``defer`` (with ``copy_state``, for a strategy
    with ``checkpoint_snapshot``, native ZeRO): only this rank's shards are copied now, no
    collective; ``state`` stays empty and ``finish(stand-in groups)`` gathers the copies later."""
    snapshot = getattr(strategy, "checkpoint_snapshot", None) if defer and copy_state else None
    finish = None
    if snapshot is not None:
        finish = snapshot(optimizer, buffers)
        state = {}
    else:
        msd, osd = strategy.checkpoint_state(optimizer)  # ZeRO: this rank's share of the canonical keys
        state = _host_copy({"model": msd, "optim": osd}, buffers) if copy_state else {"model": msd, "optim": osd}
    rng = rng_state()
    tracker = find_rng_tracker(strategy.module)
    if tracker is not None:
        rng["tp_rng"] = tracker_checkpoint_state(tracker)
    trainer = {"scheduler": copy.deepcopy(scheduler.state_dict()), "step": step}
    return StagedCheckpoint(step, state, _host_copy(rng), trainer, copy.deepcopy(meta), finish)


def save_checkpoint(run_dir: str | Path, step: int, strategy, optimizer, scheduler, meta: dict,
                    tokenizer_path: str | Path | None = None, keep: int = 0,
                    expected_bytes: int | None = None) -> Path:
    """Collectively save a checkpoint of optimizer step ``step`` (all ranks must call).

    ``strategy``: a ``parallel.base.Strategy`` (its ``state_dict`` gives the canonical FQN-keyed
    model/optimizer state, so any layout can load the checkpoint); ``meta``: JSON-able dict.
    :func:`stage_checkpoint` then :func:`write_checkpoint` (its errors, return value)."""
    staged = stage_checkpoint(step, strategy, optimizer, scheduler, meta)
    return write_checkpoint(run_dir, staged, tokenizer_path, keep, expected_bytes)


def write_checkpoint(run_dir: str | Path, staged: StagedCheckpoint, tokenizer_path: str | Path | None = None,
                     keep: int = 0, expected_bytes: int | None = None, group=None) -> Path:
    """Collectively write a staged checkpoint (all ranks of ``group`` must call; None: the default
    group; every collective of the write, DCP's included, runs on it -- a background write passes
    a group of its own, so it never interleaves with training's collectives).

    Keeps the newest ``keep`` checkpoints (0 = all); rotation runs only after the new checkpoint
    is complete, so the newest good checkpoint is never deleted. Returns the final directory.
    Raises CheckpointSpaceError on every rank, before anything is written, when the checkpoint
    directory has less free space than :func:`.space.space_needed` (the previous checkpoint's size on
    disk, else ``expected_bytes``), and CheckpointWriteError on every rank when a write fails on
    any rank (the partial directory is removed; earlier checkpoints are kept). Both messages
    (rank 0's) name the path, the bytes free and the bytes needed, and say what is kept; what to
    do next is the caller's to say."""
    rank, step = dist.get_rank(), staged.step
    root = Path(run_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"

    def check(err):
        what = _agree_error(err, group)
        if what is None:
            return
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        with watch("barrier", _named(group), "checkpoint_failed"):
            dist.barrier(group=group)
        prev = latest_checkpoint(run_dir)
        space = space_report(root, run_dir, what, expected_bytes) if rank == 0 else ""
        raise CheckpointWriteError(f"cannot write checkpoint {tmp} ({what}){space}; removed the partial directory; "
                                   + (f"the newest checkpoint {prev} is kept" if prev else "there is no earlier "
                                      "checkpoint"))
    # the free-space check, before anything is written (rank 0: the directory is shared by all ranks)
    skip = os.environ.get("ZEROTRON_FAULT_NO_SPACE_CHECK") == "1"  # fault hook: a disk filled after the check
    short = space_shortfall(root, final.name, run_dir, expected_bytes) if rank == 0 and not skip else None
    refused = _agree_error(None if short is None else CheckpointSpaceError(short), group)
    if refused is not None:
        raise CheckpointSpaceError(short or refused)
    err = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        except OSError as e:
            err = e
    check(err)
    try:
        dcp.save(staged.state, checkpoint_id=str(tmp), **({} if group is None else {"process_group": group}))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank
        err = e
    if err is None:
        try:
            _fault_write(step, rank, tmp / "rng" / f"rank_{rank}.pt")
            torch.save(staged.rng, tmp / "rng" / f"rank_{rank}.pt")
            if rank == 0:
                torch.save(staged.trainer, tmp / "trainer.pt")
                if tokenizer_path:  # with its special-token files (tokenizer_config.json, ...)
                    copy_tokenizer(tokenizer_path, tmp)
        except OSError as e:
            err = e
    check(err)
    _fault_slow_write(step)
    mine: dict[str, str] = {}
    try:  # each rank hashes what it wrote
        mine = {str(f.relative_to(tmp)): file_checksum(f) for f in own_files(tmp, rank)}
    except OSError as e:
        err = e
    check(err)
    with watch("all_gather_object", _named(group), "checkpoint_checksums"):
        known = gather_checksums(mine, group)
    if rank == 0:
        try:  # meta.json last: it lists the checksums of every file written above
            sums = complete_checksums(tmp, known)
            full = {"step": step, **staged.meta, "checksums": sums}
            full[META_CHECKSUM] = meta_checksum(full)  # meta.json covers itself
            (tmp / "meta.json").write_text(json.dumps(full, indent=1))
            if final.exists():  # re-saving the same step (e.g. after resume): the old one is set
                # aside, not deleted, until the new one is in place; a kill between the renames
                # leaves it for files.remove_stale_tmp to put back
                aside = final.with_name(SET_ASIDE + final.name)
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                os.replace(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except OSError as e:
            err = e
    check(err)
    if rank == 0 and keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    with watch("barrier", _named(group), "checkpoint_saved"):
        dist.barrier(group=group)
    return final
