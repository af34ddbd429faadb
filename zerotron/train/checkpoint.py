"""Checkpoints: ``<run-dir>/checkpoints/step_<N>/`` written atomically with torch.distributed.checkpoint.

Layout of one checkpoint directory:
    *.distcp, .metadata   model + optimizer (DCP; FQN-keyed, layout-independent)
    trainer.pt            LR-scheduler state, step (rank 0)
    rng/rank_<r>.pt       RNG states of every rank (torch CPU/CUDA, numpy, python; tensor parallel:
                          the dropout RNG tracker's states and the rank's (tp, dp, pp) coordinate)
    meta.json             step, tokens seen, the full config, world size / layout, and
                          ``checksums``: {relative path: "sha256:<hex>"} of every other file (rank 0)
    tokenizer.json        copy of the tokenizer used

Everything is written into ``.tmp_step_<N>`` first; after a barrier rank 0 renames it to
``step_<N>``. A crash (even ``kill -9``) mid-save therefore leaves earlier checkpoints intact and no
directory named ``step_*`` that is incomplete. A write error on any rank (ENOSPC, EIO, ...) is
agreed by all ranks: the partial ``.tmp_step_<N>`` is removed and CheckpointWriteError names it;
older checkpoints are untouched, and rotation (``keep``) only runs after the new one is complete.
Before writing anything, rank 0 compares the free space of the checkpoint directory with the
bytes the save will take (:func:`space_needed`: the previous checkpoint's size on disk, or the
caller's estimate for the first save); a save that cannot fit is refused on every rank
(CheckpointSpaceError) before a byte is written.
``verify_checkpoint`` re-hashes the files against meta.json's checksums (resume, generate, export).
Multi-node runs need a shared filesystem.
DCP's own plan exchange uses torch.distributed directly (it is checkpoint I/O, not training traffic).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zerotron.parallel.tensor.transform import find_rng_tracker, restore_tracker, tracker_checkpoint_state

_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or incompatible; the message names the fix."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed on some rank (raised on every rank); the partial directory was
    removed and the previous checkpoints are kept."""


class CheckpointSpaceError(CheckpointWriteError):
    """The free-space check before a save refused it (raised on every rank): nothing was written."""


def file_checksum(path: str | Path) -> str:
    """``"sha256:<hex>"`` of a file's bytes (read in 1 MiB blocks). Raises OSError."""
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def checksums(ckpt: str | Path) -> dict[str, str]:
    """Checksum of every file under a checkpoint directory except meta.json, keyed by relative path."""
    ckpt = Path(ckpt)
    return {str(f.relative_to(ckpt)): file_checksum(f) for f in sorted(ckpt.rglob("*"))
            if f.is_file() and f.name != "meta.json"}


def _own_files(ckpt: Path, rank: int) -> list[Path]:
    """The files of a checkpoint being written that rank ``rank`` wrote itself: DCP's
    ``__<rank>_*.distcp`` data files and ``rng/rank_<rank>.pt``."""
    return sorted([*ckpt.glob(f"__{rank}_*.distcp"), *(ckpt / "rng").glob(f"rank_{rank}.pt")])


def gather_checksums(mine: dict[str, str]) -> dict[str, str]:
    """Collective: every rank passes ``mine``, the checksums of the files it wrote itself
    (:func:`_own_files`: hashing is spread over the ranks, and on a multi-node run each node reads
    its own page cache); returns their union (on every rank)."""
    descs = [None] * dist.get_world_size()
    dist.all_gather_object(descs, mine)  # checkpoint I/O, like DCP: not through comm.py
    return {k: v for d in descs for k, v in d.items()}


def complete_checksums(ckpt: Path, known: dict[str, str]) -> dict[str, str]:
    """``known`` plus the checksum of every other file under ``ckpt`` except meta.json (rank 0:
    ``.metadata``, ``trainer.pt``, the tokenizer, any file no rank claimed), sorted by path: the
    same dict as :func:`checksums`. Raises OSError for an unreadable file."""
    rest = {str(f.relative_to(ckpt)): file_checksum(f) for f in sorted(ckpt.rglob("*"))
            if f.is_file() and f.name != "meta.json" and str(f.relative_to(ckpt)) not in known}
    return dict(sorted({**known, **rest}.items()))


def remove_stale_tmp(run_dir: str | Path) -> list[Path]:
    """Delete the ``checkpoints/.tmp_step_*`` directories of saves that never finished (a process
    killed mid-save); call it only while holding the run lock. Returns the removed paths."""
    root = Path(run_dir) / "checkpoints"
    stale = sorted(p for p in root.glob(".tmp_step_*") if p.is_dir()) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, sorted by step: ``[(step, path), ...]``."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Path of the newest complete checkpoint of ``run_dir`` or None."""
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


def verify_checkpoint(ckpt: str | Path, verify_checksums: bool = True) -> None:
    """Check that every data file torch.distributed.checkpoint's ``.metadata`` of ``ckpt`` refers to
    exists and is long enough (no tensor is read), and (``verify_checksums``) that every file
    listed in meta.json's ``checksums`` has that SHA-256 (checkpoints written before checksums
    existed have none and pass). Raises CheckpointError naming the first missing, truncated or
    mismatching file and, for a ``step_<N>`` of a run, the previous complete checkpoint to fall
    back to."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)

    def fail(what: str):
        m = _STEP_RE.match(ckpt.name)
        older = [p for st, p in list_checkpoints(ckpt.parent.parent) if m and st < int(m.group(1))]
        fix = (f"move it away (e.g. mv {ckpt} {ckpt.parent / ('damaged_' + ckpt.name)}) to resume from "
               f"{older[-1].name}" if older else "retrain, or restore the directory from a backup")
        err = CheckpointError(f"checkpoint {str(ckpt)!r} is damaged: {what}; {fix}")
        err.reason = what
        raise err
    if not (ckpt / ".metadata").is_file():
        fail("no .metadata from torch.distributed.checkpoint")
    try:
        md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
        fail(f".metadata is unreadable ({type(e).__name__})")
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = ckpt / rel
        if not f.is_file():
            fail(f"data file {rel} is missing")
        if f.stat().st_size < size:
            fail(f"data file {rel} is truncated ({f.stat().st_size} of >= {size} bytes)")
    for rel, want in sorted(meta.get("checksums", {}).items()) if verify_checksums else []:
        f = ckpt / rel
        if not f.is_file():
            fail(f"file {rel} is missing")
        if file_checksum(f) != want:
            fail(f"file {rel} does not match its checksum in meta.json (the bytes changed after the save)")


def newest_good_checkpoint(run_dir: str | Path, quarantine: bool, verify_checksums: bool = True) -> Path:
    """The newest checkpoint of ``run_dir`` that passes :func:`verify_checkpoint`, falling back
    past damaged ones with one warning line each. ``quarantine`` (only the process holding the
    run lock): a damaged ``step_<N>`` is renamed ``damaged_step_<N>`` (kept, never deleted, and no
    longer listed). Raises CheckpointError if there is no checkpoint or the oldest is damaged."""
    cks = list_checkpoints(run_dir)
    if not cks:
        raise CheckpointError(f"no checkpoint under {str(Path(run_dir) / 'checkpoints')!r}")
    for i in range(len(cks) - 1, -1, -1):
        path = cks[i][1]
        try:
            verify_checkpoint(path, verify_checksums)
            return path
        except CheckpointError as e:
            if i == 0 or not hasattr(e, "reason"):
                raise
            moved = ""
            if quarantine:
                dest = path.parent / f"damaged_{path.name}"
                n = 1
                while dest.exists():
                    dest, n = path.parent / f"damaged_{path.name}.{n}", n + 1
                os.replace(path, dest)
                moved = f"; moved it to {dest}"
            print(f"zerotron: warning: checkpoint {path} is damaged ({e.reason}){moved}; falling back to "
                  f"{cks[i - 1][1].name}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def rng_state() -> dict:
    """RNG states of this process (torch CPU, CUDA if present, numpy, python)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def dir_bytes(path: str | Path) -> int:
    """Total size in bytes of the files under ``path`` (0 if it does not exist)."""
    path = Path(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def dir_disk_bytes(path: str | Path) -> int:
    """Bytes the files under ``path`` take on its filesystem: per file the larger of its size and
    its allocated blocks (``st_blocks`` x 512: tmpfs and ext4 round every file up to 4 KiB)."""
    path = Path(path)
    if not path.is_dir():
        return 0
    total = 0
    for f in path.rglob("*"):
        st = f.stat()
        if f.is_file():
            total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
    return total


def space_needed(run_dir: str | Path, expected_bytes: int | None) -> tuple[int | None, str]:
    """``(bytes, basis)`` the next checkpoint of ``run_dir`` needs on disk: the size of the newest
    checkpoint (:func:`dir_disk_bytes`; the next one holds the same tensors), or, before the first,
    ``expected_bytes`` (None: unknown). ``basis`` says which, for messages."""
    prev = latest_checkpoint(run_dir)
    if prev is not None:
        return dir_disk_bytes(prev), f"the size of {prev.name}"
    return expected_bytes, "estimated from the parameter and optimizer-state bytes"


def _free_bytes(root: Path) -> int:
    """Free bytes (for an unprivileged writer) of the filesystem holding ``root`` or, when it does
    not exist yet, its nearest existing parent. Raises OSError."""
    while not root.exists() and root != root.parent:
        root = root.parent
    return shutil.disk_usage(root).free


def _space_shortfall(root: Path, name: str, run_dir: str | Path, expected_bytes: int | None) -> str | None:
    """The free-space check before a save: None when it fits (or nothing is known), else the one
    line that refuses it (path, bytes free, bytes needed and on what basis, the kept checkpoint)."""
    need, basis = space_needed(run_dir, expected_bytes)
    try:
        free = _free_bytes(root)
    except OSError:
        return None  # the write itself will report what is wrong
    if need is None or free >= need:
        return None
    prev = latest_checkpoint(run_dir)
    return (f"not writing checkpoint {name}: no space left on device: {root} has {free:,} bytes free, the "
            f"checkpoint needs about {need:,} bytes ({basis}); nothing was written; "
            + (f"the newest checkpoint {prev} is kept" if prev else "there is no earlier checkpoint"))


def _space_report(root: Path, run_dir: str | Path, what: str, expected_bytes: int | None) -> str:
    """After a failed save whose partial directory is gone: ``"; no space left on device: <root>
    has F bytes free, the checkpoint needs about N bytes (...)"`` when the disk is the cause (an
    ENOSPC on some rank, or less free than needed; torch.save on a full disk raises only
    "unexpected pos ..."), else the same numbers without the verdict."""
    need, basis = space_needed(run_dir, expected_bytes)
    try:
        free = _free_bytes(root)
    except OSError:
        return ""
    full = "No space left on device" in what or (need is not None and free < need)
    head = "; no space left on device: " if full else "; "
    return head + f"{root} has {free:,} bytes free" + (
        f", the checkpoint needs about {need:,} bytes ({basis})" if need is not None else "")


def save_checkpoint(run_dir: str | Path, step: int, strategy, optimizer, scheduler, meta: dict,
                    tokenizer_path: str | Path | None = None, keep: int = 0,
                    expected_bytes: int | None = None) -> Path:
    """Collectively save a checkpoint of optimizer step ``step`` (all ranks must call).

    ``strategy``: a ``parallel.base.Strategy`` (its ``state_dict`` gives the canonical FQN-keyed
    model/optimizer state, so any layout can load the checkpoint); ``meta``: JSON-able dict.
    Keeps the newest ``keep`` checkpoints (0 = all); rotation runs only after the new checkpoint
    is complete, so the newest good checkpoint is never deleted. Returns the final directory.
    Raises CheckpointSpaceError on every rank, before anything is written, when the checkpoint
    directory has less free space than :func:`space_needed` (the previous checkpoint's size on
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
        space = _space_report(root, run_dir, what, expected_bytes) if rank == 0 else ""
        raise CheckpointWriteError(f"cannot write checkpoint {tmp} ({what}){space}; removed the partial directory; "
                                   + (f"the newest checkpoint {prev} is kept" if prev else "there is no earlier "
                                      "checkpoint"))
    # the free-space check, before anything is written (rank 0: the directory is shared by all ranks)
    skip = os.environ.get("ZEROTRON_FAULT_NO_SPACE_CHECK") == "1"  # fault hook: a disk filled after the check
    short = _space_shortfall(root, final.name, run_dir, expected_bytes) if rank == 0 and not skip else None
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
                if tokenizer_path:
                    shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        except OSError as e:
            err = e
    check(err)
    mine: dict[str, str] = {}
    try:  # each rank hashes what it wrote
        mine = {str(f.relative_to(tmp)): file_checksum(f) for f in _own_files(tmp, rank)}
    except OSError as e:
        err = e
    check(err)
    known = gather_checksums(mine)
    if rank == 0:
        try:  # meta.json last: it lists the checksums of every file written above
            sums = complete_checksums(tmp, known)
            (tmp / "meta.json").write_text(json.dumps({"step": step, **meta, "checksums": sums}, indent=1))
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


def read_meta(ckpt: str | Path) -> dict:
    """meta.json of a checkpoint directory. Raises CheckpointError if it is not a checkpoint."""
    f = Path(ckpt) / "meta.json"
    if not f.is_file():
        raise CheckpointError(f"{str(ckpt)!r} is not a zerotron checkpoint (no meta.json); pass a "
                              "<run-dir>/checkpoints/step_<N> directory or a run directory")
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{str(f)!r} is corrupt ({e}); use another checkpoints/step_<N> directory "
                              "(an older one) or retrain") from None


@torch.no_grad()
def init_optimizer_state(optimizer) -> None:
    """Create the optimizer's per-parameter state (e.g. Adam's step, exp_avg, exp_avg_sq) with a
    zero-gradient step at lr = 0, so a checkpoint can be loaded into it. Parameters are unchanged.
    (torch's own helper skips this when gradients already exist, as they do when gradients are
    views into DDP's flat buffers.)"""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def load_checkpoint(ckpt: str | Path, strategy, optimizer=None, scheduler=None, restore_rng: bool = True) -> dict:
    """Collectively load model (and optimizer, scheduler, this rank's RNG) state from ``ckpt``.

    ``strategy``: a ``parallel.base.Strategy`` (or a plain ``nn.Module``, wrapped in one).
    ``restore_rng`` also restores the tensor-parallel dropout RNG tracker when the rank file was
    saved at the same coordinate; at another layout the tracker is re-seeded from train.seed +
    step and (with dropout > 0) one line per rank says so (``tensor.transform.restore_tracker``).

    Works at any world size (DCP reshards). Returns the checkpoint's meta dict.
    Raises CheckpointError for a missing/incomplete checkpoint or mismatched shapes."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    if not (ckpt / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is incomplete (no .metadata from "
                              "torch.distributed.checkpoint); use another checkpoints/step_<N> directory")
    if isinstance(strategy, torch.nn.Module):
        from ..parallel.base import Strategy

        strategy = Strategy(strategy)
    try:
        if optimizer is not None:
            init_optimizer_state(optimizer)
        msd, osd = strategy.checkpoint_state(optimizer)
        state = {"model": msd} if optimizer is None else {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt))
        strategy.load_checkpoint_state(state["model"], state.get("optim"), optimizer)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {str(ckpt)!r}: {first[:300]}. A file may be missing or "
                              "damaged, or the model config differs from the saved one; use another "
                              "checkpoints/step_<N> directory") from None
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=False)["scheduler"])
    rng_file = ckpt / "rng" / f"rank_{dist.get_rank() if dist.is_initialized() else 0}.pt"
    if restore_rng:
        saved = torch.load(rng_file, weights_only=False) if rng_file.is_file() else {}
        if saved:
            set_rng_state(saved)
        tracker = find_rng_tracker(strategy.module)
        if tracker is not None:  # tensor parallel: restored, or re-seeded when the layout changed
            msg = restore_tracker(tracker, saved.get("tp_rng"), int(meta.get("step", 0)))
            if msg and getattr(getattr(strategy.module, "config", None), "dropout", 0) > 0:
                print(msg, flush=True)
    return meta
