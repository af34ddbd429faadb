"""Checkpoints: ``<run-dir>/checkpoints/step_<N>/`` written atomically with torch.distributed.checkpoint.

Layout of one checkpoint directory:
    *.distcp, .metadata   model + optimizer (DCP; FQN-keyed, layout-independent)
    trainer.pt            LR-scheduler state, step (rank 0)
    rng/rank_<r>.pt       RNG states of every rank (torch CPU/CUDA, numpy, python; tensor parallel:
                          the dropout RNG tracker's states and the rank's (tp, dp, pp) coordinate)
    meta.json             step, tokens seen, the full config, world size / layout (rank 0)
    tokenizer.json        copy of the tokenizer used

Everything is written into ``.tmp_step_<N>`` first; after a barrier rank 0 renames it to
``step_<N>``. A crash (even ``kill -9``) mid-save therefore leaves earlier checkpoints intact and no
directory named ``step_*`` that is incomplete. Multi-node runs need a shared filesystem.
DCP's own plan exchange uses torch.distributed directly (it is checkpoint I/O, not training traffic).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..parallel.tp_model import find_rng_tracker, restore_tracker, tracker_checkpoint_state

_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or incompatible; the message names the fix."""


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


def verify_checkpoint(ckpt: str | Path) -> None:
    """Check that every data file torch.distributed.checkpoint's ``.metadata`` of ``ckpt`` refers to
    exists and is long enough (no tensor is read). Raises CheckpointError naming the first missing
    or truncated file and, for a ``step_<N>`` of a run, the previous complete checkpoint to fall
    back to."""
    ckpt = Path(ckpt)
    read_meta(ckpt)

    def fail(what: str):
        m = _STEP_RE.match(ckpt.name)
        older = [p for st, p in list_checkpoints(ckpt.parent.parent) if m and st < int(m.group(1))]
        fix = (f"move it away (e.g. mv {ckpt} {ckpt.parent / ('damaged_' + ckpt.name)}) to resume from "
               f"{older[-1].name}" if older else "retrain, or restore the directory from a backup")
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is damaged: {what}; {fix}")
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


def save_checkpoint(run_dir: str | Path, step: int, strategy, optimizer, scheduler, meta: dict,
                    tokenizer_path: str | Path | None = None, keep: int = 0) -> Path:
    """Collectively save a checkpoint of optimizer step ``step`` (all ranks must call).

    ``strategy``: a ``parallel.base.Strategy`` (its ``state_dict`` gives the canonical FQN-keyed
    model/optimizer state, so any layout can load the checkpoint); ``meta``: JSON-able dict.
    Keeps the newest ``keep`` checkpoints (0 = all). Returns the final directory."""
    rank = dist.get_rank()
    root = Path(run_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    msd, osd = strategy.checkpoint_state(optimizer)  # ZeRO: this rank's share of the canonical keys
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    rng = rng_state()
    tracker = find_rng_tracker(strategy.module)
    if tracker is not None:
        rng["tp_rng"] = tracker_checkpoint_state(tracker)
    torch.save(rng, tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), "step": step}, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        if tokenizer_path:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    dist.barrier()
    if rank == 0:
        if final.exists():  # re-saving the same step (e.g. after resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep > 0:
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
    step and (with dropout > 0) one line per rank says so (``tp_model.restore_tracker``).

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
