"""TensorBoard event files in the run directory (``log.tensorboard``: auto | true | false).

``tensorboard --logdir runs/`` then shows every run by its directory name. The scalars are those of
metrics.jsonl, by tag (:data:`TAGS`, plus ``comm/<op>/<group>`` bytes per step); the step is the
optimizer step. ``tensorboard`` is an optional dependency imported only here and only when a
writer is opened: every other module imports without it.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from ..config import ConfigError

MODES = ("auto", "true", "false")
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
        "tflops_per_device": "perf/tflops_per_device", "model_state_bytes": "memory/model_state_bytes",
        "comm_bytes": "comm/bytes_total", "pp_bubble_fraction": "perf/pp_bubble_fraction",
        "moe_aux_loss": "moe/aux_loss", "moe_z_loss": "moe/z_loss", "moe_load_max_mean_avg": "moe/load_max_mean"}


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


def _quiet_writer_thread_errors() -> None:
    """Keep the OSError that kills tensorboard's writer thread (disk full) out of stderr: the
    thread stores it and :class:`TensorBoardLogger` reports it in one line. Other threads' errors
    go to the previous hook. Installed once per process."""
    prev = threading.excepthook
    if getattr(prev, "_zerotron_tb", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        prev(args)
    hook._zerotron_tb = True
    threading.excepthook = hook


class TensorBoardLogger:
    """A ``SummaryWriter`` on ``run_dir``; ``log(record)`` writes the scalars of one metrics record.
    On resume (``resume_step`` k) events of steps > k left by a run that died are purged. An event
    file that cannot be written (disk full) ends the TensorBoard log with one warning line; the
    run goes on (metrics.jsonl is the run's record, with its own policy)."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_thread_errors()
        self.writer = SummaryWriter(str(run_dir), purge_step=None if resume_step is None else resume_step + 1)

    def _failed(self, e: OSError, step: str) -> None:
        print(f"zerotron: warning: TensorBoard events stop {step}: cannot write the event file "
              f"({e.strerror or e}); metrics.jsonl keeps the records (log.tensorboard)", file=sys.stderr, flush=True)
        try:
            self.writer.close()
        except OSError:
            pass
        self.writer = None

    def log(self, rec: dict) -> None:
        """Every known scalar of ``rec`` (:data:`TAGS`), ``comm/<op>/<group>`` bytes and (MoE) the
        per-layer expert load ``moe/load_max_mean/layer<i>`` at ``rec["step"]``."""
        if self.writer is None:
            return
        step = rec["step"]
        try:
            for key, tag in TAGS.items():
                if rec.get(key) is not None:
                    self.writer.add_scalar(tag, rec[key], step)
            for op, b in (rec.get("comm_bytes_by_op") or {}).items():
                self.writer.add_scalar(f"comm/{op}", b, step)
            for layer, v in enumerate(rec.get("moe_load_max_mean") or []):  # MoE: per-layer expert load
                self.writer.add_scalar(f"moe/load_max_mean/layer{layer}", v, step)
        except OSError as e:
            self._failed(e, f"at step {step}")

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is None:
            return
        try:
            self.writer.close()
        except OSError as e:
            self._failed(e, "at the end of the run")


def open_tensorboard(mode: str, run_dir: str | Path, resume_step: int | None, lead: bool):
    """The run's logger, or None (mode off / package missing under "auto" / not rank 0). Call on
    every rank: a bad mode raises ConfigError everywhere alike."""
    on = tensorboard_enabled(mode)
    return TensorBoardLogger(run_dir, resume_step) if on and lead else None
