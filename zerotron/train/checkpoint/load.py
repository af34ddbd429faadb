"""Loading a checkpoint collectively into any layout (DCP reshards), with the optimizer, the LR
scheduler and this rank's RNG states."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zerotron.models.layout import persistent_buffers
from zerotron.parallel.tensor.transform import find_rng_tracker, restore_tracker

from .files import CheckpointError, read_meta
from .rng import set_rng_state


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


def _absent_buffers(ckpt: Path, msd: dict, module) -> dict:
    """The entries of the model state ``msd`` that are persistent buffers of ``module``
    (``models.layout.persistent_buffers``, e.g. the MoE ``expert_bias``) and that the checkpoint's
    DCP metadata does not list: a checkpoint written before ZeRO saved buffers, or by a model
    without them (``moe_bias_update_rate`` 0). They are left out of the load and keep their current
    values; rank 0 prints one line naming them. Any other missing key still fails the load."""
    names = set(persistent_buffers(module))
    if not names & msd.keys():
        return {}
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    absent = {k: v for k, v in msd.items() if k in names and f"model.{k}" not in saved}
    if absent and (not dist.is_initialized() or dist.get_rank() == 0):
        shown = ", ".join(sorted(absent)[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
        print(f"note: checkpoint {str(ckpt)!r} holds no {shown} (saved without the model's persistent buffers); "
              "they keep their initial values", flush=True)
    return absent


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
        from zerotron.parallel.base import Strategy

        strategy = Strategy(strategy)
    # the kernel choice is this run's (train.optimizer_impl, or what the strategy forces), not the saved
    # run's: torch's load_state_dict would copy the checkpoint's "fused"/"foreach" group options over it
    kernels = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups] if optimizer else []
    try:
        if optimizer is not None:
            init_optimizer_state(optimizer)
        msd, osd = strategy.checkpoint_state(optimizer)
        absent = _absent_buffers(ckpt, msd, strategy.module)
        state = {"model": {k: v for k, v in msd.items() if k not in absent}}
        if optimizer is not None:
            state["optim"] = osd
        dcp.load(state, checkpoint_id=str(ckpt))
        state["model"].update(absent)  # an older checkpoint without them: the buffers keep their values
        strategy.load_checkpoint_state(state["model"], state.get("optim"), optimizer)
        for g, kern in zip(optimizer.param_groups if optimizer else [], kernels):
            g.update(kern)
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
