"""Saving a checkpoint collectively: written into ``.tmp_step_<N>``, checksummed, renamed to
``step_<N>`` by rank 0, then older checkpoints rotated (see the package docstring)."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zerotron.data.tokenizer import copy_tokenizer
from zerotron.parallel.tensor.transform import find_rng_tracker, tracker_checkpoint_state

from .files import CheckpointSpaceError, CheckpointWriteError, latest_checkpoint, list_checkpoints
from .integrity import META_CHECKSUM, complete_checksums, file_checksum, gather_checksums, meta_checksum, own_files
from .rng import rng_state
from .space import space_report, space_shortfall


def _agree_error(err: BaseException | None) -> str | None:
    """Collective: None if no rank failed, else the first failing rank's one-line description."""
    flag = torch.tensor([0.0 if err is None else 1.0], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # checkpoint I/O: like DCP, not through comm.py
    if flag.item() == 0:
        return None
    descs = [None] * dist.get_world_size()
    mine = None if err is None else (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
    dist.all_gather_object(descs, mine)
    return next(f"rank {r}: {d}" for r, d in enumerate(descs) if d is not None)


def _fault_write(step: int, rank: int, path: Path) -> None:
    """Fault hook for tests: ZEROTRON_FAULT_SAVE_ENOSPC_AT_STEP=N (ZEROTRON_FAULT_SAVE_RANK=r,
    default 0) makes this rank's save of step N fail as a full disk would. (ZEROTRON_FAULT_NO_SPACE_CHECK=1
    skips the free-space check before each save, as if another writer filled the disk after it.)"""
    if os.environ.get("ZEROTRON_FAULT_SAVE_ENOSPC_AT_STEP") == str(step) and \
            os.environ.get("ZEROTRON_FAULT_SAVE_RANK", "0") == str(rank):
        path.write_bytes(b"\0" * 100)  # a partial file, as a full disk leaves
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))


def save_checkpoint(run_dir: str | Path, step: int, strategy, optimizer, scheduler, meta: dict,
                    tokenizer_path: str | Path | None = None, keep: int = 0,
                    expected_bytes: int | None = None) -> Path:
    """Collectively save a checkpoint of optimizer step ``step`` (all ranks must call).

    ``strategy``: a ``parallel.base.Strategy`` (its ``state_dict`` gives the canonical FQN-keyed
    model/optimizer state, so any layout can load the checkpoint); ``meta``: JSON-able dict.
    Keeps the newest ``keep`` checkpoints (0 = all); rotation runs only after the new checkpoint
    is complete, so the newest good checkpoint is never deleted. Returns the final directory.
    Raises CheckpointSpaceError on every rank, before anything is written, when the checkpoint
    directory has less free space than :func:`.space.space_needed` (the previous checkpoint's size on
    disk, else ``expected_bytes``), and CheckpointWriteError on every rank when a write fails on
    any rank (the partial directory is removed; earlier checkpoints are kept). Both messages
    (rank 0's) name the path, the bytes free and the bytes needed, and say what is kept; what to
    do next is the caller's to say."""
    rank = dist.get_rank()
    root = Path(run_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"

    def check(err):
        what = _agree_error(err)
        if what is None:
            return
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        prev = latest_checkpoint(run_dir)
        space = space_report(root, run_dir, what, expected_bytes) if rank == 0 else ""
        raise CheckpointWriteError(f"cannot write checkpoint {tmp} ({what}){space}; removed the partial directory; "
                                   + (f"the newest checkpoint {prev} is kept" if prev else "there is no earlier "
                                      "checkpoint"))
    # the free-space check, before anything is written (rank 0: the directory is shared by all ranks)
    skip = os.environ.get("ZEROTRON_FAULT_NO_SPACE_CHECK") == "1"  # fault hook: a disk filled after the check
    short = space_shortfall(root, final.name, run_dir, expected_bytes) if rank == 0 and not skip else None
    refused = _agree_error(None if short is None else CheckpointSpaceError(short))
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
    msd, osd = strategy.checkpoint_state(optimizer)  # ZeRO: this rank's share of the canonical keys
    try:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank
        err = e
    if err is None:
        try:
            rng = rng_state()
            tracker = find_rng_tracker(strategy.module)
            if tracker is not None:
                rng["tp_rng"] = tracker_checkpoint_state(tracker)
            _fault_write(step, rank, tmp / "rng" / f"rank_{rank}.pt")
            torch.save(rng, tmp / "rng" / f"rank_{rank}.pt")
            if rank == 0:
                torch.save({"scheduler": scheduler.state_dict(), "step": step}, tmp / "trainer.pt")
                if tokenizer_path:  # with its special-token files (tokenizer_config.json, ...)
                    copy_tokenizer(tokenizer_path, tmp)
        except OSError as e:
            err = e
    check(err)
    mine: dict[str, str] = {}
    try:  # each rank hashes what it wrote
        mine = {str(f.relative_to(tmp)): file_checksum(f) for f in own_files(tmp, rank)}
    except OSError as e:
        err = e
    check(err)
    known = gather_checksums(mine)
    if rank == 0:
        try:  # meta.json last: it lists the checksums of every file written above
            sums = complete_checksums(tmp, known)
            full = {"step": step, **meta, "checksums": sums}
            full[META_CHECKSUM] = meta_checksum(full)  # meta.json covers itself
            (tmp / "meta.json").write_text(json.dumps(full, indent=1))
            if final.exists():  # re-saving the same step (e.g. after resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        except OSError as e:
            err = e
    check(err)
    if rank == 0 and keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


