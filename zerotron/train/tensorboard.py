"""TensorBoard event files in the run directory (``log.tensorboard``: auto | true | false).

``tensorboard --logdir runs/`` then shows every run by its directory name. The scalars are those of
metrics.jsonl, by tag (:data:`TAGS`, plus ``comm/<op>/<group>`` bytes per step); the step is the
optimizer step. ``tensorboard`` is an optional dependency imported only here and only when a
writer is opened: every other module imports without it.
"""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError

MODES = ("auto", "true", "false")
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
        "tflops_per_device": "perf/tflops_per_device", "model_state_bytes": "memory/model_state_bytes",
        "comm_bytes": "comm/bytes_total", "pp_bubble_fraction": "perf/pp_bubble_fraction"}


def tensorboard_available() -> bool:
    """True when ``torch.utils.tensorboard.SummaryWriter`` can be imported (the tensorboard package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def tensorboard_enabled(mode: str) -> bool:
    """Resolve ``log.tensorboard``: "auto" = installed or not; "true" needs the package; "false".
    Raises ConfigError for another value, or for "true" without the package (naming the fix)."""
    if mode not in MODES:
        raise ConfigError(f"log.tensorboard must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "false":
        return False
    ok = tensorboard_available()
    if mode == "true" and not ok:
        raise ConfigError("log.tensorboard = true needs the tensorboard package: pip install tensorboard "
                          "(or set log.tensorboard = auto or false)")
    return ok


class TensorBoardLogger:
    """A ``SummaryWriter`` on ``run_dir``; ``log(record)`` writes the scalars of one metrics record.
    On resume (``resume_step`` k) events of steps > k left by a run that died are purged."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, rec: dict) -> None:
        """Every known scalar of ``rec`` (:data:`TAGS`) and ``comm/<op>/<group>`` bytes at ``rec["step"]``."""
        step = rec["step"]
        for key, tag in TAGS.items():
            if rec.get(key) is not None:
                self.writer.add_scalar(tag, rec[key], step)
        for op, b in (rec.get("comm_bytes_by_op") or {}).items():
            self.writer.add_scalar(f"comm/{op}", b, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def open_tensorboard(mode: str, run_dir: str | Path, resume_step: int | None, lead: bool):
    """The run's logger, or None (mode off / package missing under "auto" / not rank 0). Call on
    every rank: a bad mode raises ConfigError everywhere alike."""
    on = tensorboard_enabled(mode)
    return TensorBoardLogger(run_dir, resume_step) if on and lead else None
