"""Checkpoint directories of a run: the error types, listing ``checkpoints/step_<N>``, meta.json,
removing the ``.tmp_step_*`` of saves that never finished, and the bytes a directory takes."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d+)$")
"""the name of a complete checkpoint directory; group 1 is the step"""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or incompatible; the message names the fix."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed on some rank (raised on every rank); the partial directory was
    removed and the previous checkpoints are kept."""


class CheckpointSpaceError(CheckpointWriteError):
    """The free-space check before a save refused it (raised on every rank): nothing was written."""


SET_ASIDE = ".old_"  # a re-saved step's previous checkpoint while the new one is renamed in


def checkpoints_root(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``, the folder of a run's ``step_<N>`` checkpoints (it may not exist
    yet). Raises CheckpointError if something else is in its place (a file, a link to nothing):
    listing it found no checkpoint (a finished run looked like one stopped before its first save,
    and the advice was to delete the run directory), and a fresh run trained to its first save and
    then failed with 'free disk space'."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir() or not (root.exists() or root.is_symlink()):
        return root
    what = "a link to nothing" if not root.exists() else "a file" if root.is_file() else "not a folder"
    raise CheckpointError(f"{str(root)!r} is {what}, not a folder: a run keeps its checkpoints/step_<N> "
                          "directories there; move or rename it, then run the command again (nothing was written)")


def remove_stale_tmp(run_dir: str | Path) -> list[Path]:
    """Delete the ``checkpoints/.tmp_step_*`` directories of saves that never finished (a process
    killed mid-save) and settle a re-save of one step that a kill cut between its renames: a
    ``.old_step_<N>`` (the step's previous checkpoint, set aside by ``save.write_checkpoint``)
    goes back to ``step_<N>`` when no new ``step_<N>`` was renamed in, and is deleted when one was.
    Call it only while holding the run lock. Returns the removed ``.tmp_step_*`` paths."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    for old in sorted(p for p in root.glob(SET_ASIDE + "step_*") if p.is_dir()):
        final = root / old.name[len(SET_ASIDE):]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    stale = sorted(p for p in root.glob(".tmp_step_*") if p.is_dir())
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, sorted by step: ``[(step, path), ...]``. Raises
    CheckpointError if ``<run_dir>/checkpoints`` is not a folder (:func:`checkpoints_root`)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Path of the newest complete checkpoint of ``run_dir`` or None."""
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


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


