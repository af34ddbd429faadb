"""Checkpoint integrity: SHA-256 checksums of the files of a checkpoint (recorded in meta.json's
``checksums`` at save time), verification against them and against torch.distributed.checkpoint's
``.metadata``, and the fallback past damaged checkpoints to the newest good one."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from .files import STEP_RE, CheckpointError, list_checkpoints, read_meta


def file_checksum(path: str | Path) -> str:
    """``"sha256:<hex>"`` of a file's bytes (read in 1 MiB blocks). Raises OSError."""
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


META_CHECKSUM = "meta_checksum"
"""the meta.json key holding :func:`meta_checksum` of the rest of meta.json"""


def meta_checksum(meta: dict) -> str:
    """``"sha256:<hex>"`` of meta.json's contents without its own ``meta_checksum`` key, in a
    canonical form (keys sorted, no spaces, after a JSON round trip: the dict being written and the
    dict read back give the same value). Raises TypeError for a value JSON cannot hold."""
    rest = json.loads(json.dumps({k: v for k, v in meta.items() if k != META_CHECKSUM}))
    canon = json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


def checksums(ckpt: str | Path) -> dict[str, str]:
    """Checksum of every file under a checkpoint directory except meta.json, keyed by relative path."""
    ckpt = Path(ckpt)
    return {str(f.relative_to(ckpt)): file_checksum(f) for f in sorted(ckpt.rglob("*"))
            if f.is_file() and f.name != "meta.json"}


def own_files(ckpt: Path, rank: int) -> list[Path]:
    """The files of a checkpoint being written that rank ``rank`` wrote itself: DCP's
    ``__<rank>_*.distcp`` data files and ``rng/rank_<rank>.pt``."""
    return sorted([*ckpt.glob(f"__{rank}_*.distcp"), *(ckpt / "rng").glob(f"rank_{rank}.pt")])


def gather_checksums(mine: dict[str, str], group=None) -> dict[str, str]:
    """Collective: every rank passes ``mine``, the checksums of the files it wrote itself
    (:func:`own_files`: hashing is spread over the ranks, and on a multi-node run each node reads
    its own page cache); returns their union (on every rank). ``group``: the process group (None:
    the default one)."""
    descs = [None] * dist.get_world_size(group)
    dist.all_gather_object(descs, mine, group=group)  # checkpoint I/O, like DCP: not through comm.py
    return {k: v for d in descs for k, v in d.items()}


def complete_checksums(ckpt: Path, known: dict[str, str]) -> dict[str, str]:
    """``known`` plus the checksum of every other file under ``ckpt`` except meta.json (rank 0:
    ``.metadata``, ``trainer.pt``, the tokenizer, any file no rank claimed), sorted by path: the
    same dict as :func:`checksums`. Raises OSError for an unreadable file."""
    rest = {str(f.relative_to(ckpt)): file_checksum(f) for f in sorted(ckpt.rglob("*"))
            if f.is_file() and f.name != "meta.json" and str(f.relative_to(ckpt)) not in known}
    return dict(sorted({**known, **rest}.items()))


def verify_checkpoint(ckpt: str | Path, verify_checksums: bool = True) -> None:
    """Check that every data file torch.distributed.checkpoint's ``.metadata`` of ``ckpt`` refers to
    exists and is long enough (no tensor is read), and (``verify_checksums``) that every file
    listed in meta.json's ``checksums`` has that SHA-256 (checkpoints written before checksums
    existed have none and pass). meta.json itself is always checked (it is small): it must parse,
    match its own ``meta_checksum`` (checkpoints saved before that key existed have none and
    pass: the check catches accidental change -- an edit, a torn or stale file -- not a
    deliberate one that also deletes the key), hold a non-empty ``model_config`` object, and, for a
    ``step_<N>`` directory, say ``"step": N``. Raises CheckpointError naming the
    first missing, truncated or mismatching file and, for a ``step_<N>`` of a run, the previous
    complete checkpoint to fall back to (``.reason``: what is wrong, for the fallback)."""
    ckpt = Path(ckpt)

    def fail(what: str):
        m = STEP_RE.match(ckpt.name)
        older = [p for st, p in list_checkpoints(ckpt.parent.parent) if m and st < int(m.group(1))]
        fix = (f"move it away (e.g. mv {ckpt} {ckpt.parent / ('damaged_' + ckpt.name)}) to resume from "
               f"{older[-1].name}" if older else "retrain, or restore the directory from a backup")
        err = CheckpointError(f"checkpoint {str(ckpt)!r} is damaged: {what}; {fix}")
        err.reason = what
        raise err
    if not (ckpt / "meta.json").is_file():
        if STEP_RE.match(ckpt.name) and ckpt.parent.name == "checkpoints":
            # a step_<N> of a run: damaged, --resume falls back (zerotron's own saves appear whole, by a
            # rename; an empty or half-copied one is a copy that never arrived: was "not a zerotron
            # checkpoint", which stopped --resume, generate and export of the run directory)
            fail("meta.json is missing" + ("" if (ckpt / ".metadata").is_file() else
                                           " and so is DCP's .metadata (an empty or partly copied directory)"))
        read_meta(ckpt)  # not a checkpoint at all: read_meta's message
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (ValueError, OSError) as e:  # a torn or unreadable meta.json: damaged, like a shard
        fail(f"meta.json is unreadable ({type(e).__name__})")
    if not isinstance(meta, dict):
        fail("meta.json is not a JSON object")
    if META_CHECKSUM in meta and meta_checksum(meta) != meta[META_CHECKSUM]:
        fail("meta.json does not match its own meta_checksum (it was edited after the save)")
    m = STEP_RE.match(ckpt.name)
    if m and (type(meta.get("step")) is not int or meta["step"] != int(m.group(1))):
        fail(f"meta.json says step {meta.get('step')!r} in directory {ckpt.name}")
    if not isinstance(meta.get("checksums", {}), dict):
        fail("meta.json's checksums is not a JSON object")
    if not isinstance(meta.get("model_config"), dict) or not meta["model_config"]:  # every save writes it
        fail("meta.json has no model_config (the model's shape)")  # was a KeyError traceback in generate
    if not (ckpt / ".metadata").is_file():
        fail("no .metadata from torch.distributed.checkpoint")
    import torch.distributed.checkpoint as dcp  # here: 1 s of imports the launcher and --help skip

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

