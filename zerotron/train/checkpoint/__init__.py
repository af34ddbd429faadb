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
bytes the save will take (``space.space_needed``: the previous checkpoint's size on disk, or the
caller's estimate for the first save); a save that cannot fit is refused on every rank
(CheckpointSpaceError) before a byte is written.
``integrity.verify_checkpoint`` re-hashes the files against meta.json's checksums (resume, generate, export).
Multi-node runs need a shared filesystem.

Modules: ``files`` (errors, listing, meta.json, stale ``.tmp_step_*``, directory bytes),
``integrity`` (checksums, verification, fallback to the newest good checkpoint), ``space`` (the
free-space check), ``rng`` (per-rank RNG states), ``save`` and ``load`` (the collective save/load).
The names below are the package's API (what the trainer, ``generate`` and ``serve`` use); import
anything else from its module.
"""
from .files import (
    CheckpointError,
    CheckpointSpaceError,
    CheckpointWriteError,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
)
from .integrity import newest_good_checkpoint, verify_checkpoint

_LAZY = {"load_checkpoint": "load", "save_checkpoint": "save"}


def __getattr__(name: str):
    """``load_checkpoint`` / ``save_checkpoint`` import their module (and torch.distributed.checkpoint,
    ~1 s) on first use: the launcher of ``--nproc``, which only lists and verifies checkpoints,
    never pays for it."""
    if name in _LAZY:
        import importlib

        fn = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointError", "CheckpointSpaceError", "CheckpointWriteError", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "newest_good_checkpoint", "read_meta", "save_checkpoint", "verify_checkpoint"]
