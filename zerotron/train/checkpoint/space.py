"""Disk space of checkpoint saves: the bytes the next save needs, the free-space check that refuses
a save before a byte is written, and the numbers a failed save's message reports."""
from __future__ import annotations

import shutil
from pathlib import Path

from .files import dir_disk_bytes, latest_checkpoint


def space_needed(run_dir: str | Path, expected_bytes: int | None) -> tuple[int | None, str]:
    """``(bytes, basis)`` the next checkpoint of ``run_dir`` needs on disk: the size of the newest
    checkpoint (:func:`dir_disk_bytes`; the next one holds the same tensors), or, before the first,
    ``expected_bytes`` (None: unknown). ``basis`` says which, for messages."""
    prev = latest_checkpoint(run_dir)
    if prev is not None:
        return dir_disk_bytes(prev), f"the size of {prev.name}"
    return expected_bytes, "estimated from the parameter and optimizer-state bytes"


def free_bytes(root: Path) -> int:
    """Free bytes (for an unprivileged writer) of the filesystem holding ``root`` or, when it does
    not exist yet, its nearest existing parent. Raises OSError."""
    while not root.exists() and root != root.parent:
        root = root.parent
    return shutil.disk_usage(root).free


def space_shortfall(root: Path, name: str, run_dir: str | Path, expected_bytes: int | None) -> str | None:
    """The free-space check before a save: None when it fits (or nothing is known), else the one
    line that refuses it (path, bytes free, bytes needed and on what basis, the kept checkpoint)."""
    need, basis = space_needed(run_dir, expected_bytes)
    try:
        free = free_bytes(root)
    except OSError:
        return None  # the write itself will report what is wrong
    if need is None or free >= need:
        return None
    prev = latest_checkpoint(run_dir)
    return (f"not writing checkpoint {name}: no space left on device: {root} has {free:,} bytes free, the "
            f"checkpoint needs about {need:,} bytes ({basis}); nothing was written; "
            + (f"the newest checkpoint {prev} is kept" if prev else "there is no earlier checkpoint"))


def space_report(root: Path, run_dir: str | Path, what: str, expected_bytes: int | None) -> str:
    """After a failed save whose partial directory is gone: ``"; no space left on device: <root>
    has F bytes free, the checkpoint needs about N bytes (...)"`` when the disk is the cause (an
    ENOSPC on some rank, or less free than needed; torch.save on a full disk raises only
    "unexpected pos ..."), else the same numbers without the verdict."""
    need, basis = space_needed(run_dir, expected_bytes)
    try:
        free = free_bytes(root)
    except OSError:
        return ""
    full = "No space left on device" in what or (need is not None and free < need)
    head = "; no space left on device: " if full else "; "
    return head + f"{root} has {free:,} bytes free" + (
        f", the checkpoint needs about {need:,} bytes ({basis})" if need is not None else "")


