"""Optional Weights & Biases logging (``log.wandb = true``), always in offline mode.

The run is written under ``<run_dir>/wandb/`` and never contacts a server; upload it later with
``wandb sync <run_dir>/wandb/offline-run-*``. The scalars are those of TensorBoard (the same tags,
:data:`.tensorboard.TAGS`, plus ``comm/<op>/<group>`` bytes per step) at the optimizer step.
``wandb`` is an optional dependency imported only here and only when a run is opened.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import ConfigError
from .tensorboard import TAGS


def wandb_available() -> bool:
    """True when the ``wandb`` package is installed (found without importing it)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except ValueError:  # a stub module in sys.modules without __spec__
        return True


def wandb_enabled(on: bool) -> bool:
    """Resolve ``log.wandb``; raises ConfigError for ``True`` without the package (naming the fix)."""
    if on and not wandb_available():
        raise ConfigError("log.wandb = true needs the wandb package: pip install wandb (or set log.wandb = false)")
    return bool(on)


class WandbLogger:
    """An offline wandb run in ``run_dir/wandb``; ``log(record)`` logs the scalars of one metrics record."""

    def __init__(self, run_dir: str | Path, project: str, config: dict):
        import wandb

        run_dir = Path(run_dir)
        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), mode="offline", config=config)

    def log(self, rec: dict) -> None:
        """Every known scalar of ``rec`` and ``comm/<op>/<group>`` bytes, at ``rec["step"]``."""
        row = {tag: rec[key] for key, tag in TAGS.items() if rec.get(key) is not None}
        row.update({f"comm/{op}": b for op, b in (rec.get("comm_bytes_by_op") or {}).items()})
        self.run.log(row, step=rec["step"])

    def close(self) -> None:
        """Finish the run (writes its files)."""
        self.run.finish()


def open_wandb(on: bool, project: str, run_dir: str | Path, config: dict, lead: bool):
    """The run's W&B logger, or None (off, or not rank 0). Call on every rank: a missing package
    raises ConfigError everywhere alike. A resumed or restarted run opens a new offline run (its
    steps continue from the checkpoint's)."""
    return WandbLogger(run_dir, project, config) if wandb_enabled(on) and lead else None
