"""Rank 0's progress display: a tqdm bar on a terminal, plain lines in a log file.

On a terminal (the stream's ``isatty()``) a tqdm bar shows loss, the last validation loss and
tokens/s. Anywhere else (CI logs, ``2> train.log``, Slurm output) carriage-return bar updates are
noise, so one line is printed every ``every`` steps (and at the first and last step)::

    step 20/100  loss 4.1873  val 4.2311  tokens/s 10,512  ETA 0:00:41

``val`` appears on the lines that follow a new validation, ETA = wall time per step so far (with
evaluation and checkpoints) x steps left.
"""
from __future__ import annotations

import sys
import time


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative number of seconds (rounded)."""
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """``Progress(total, initial, every)``; ``update(record)`` after each optimizer step with the
    metrics record (``step``, ``loss``, ``tokens_per_s``, optional ``val_loss``); ``close()`` at
    the end. ``stream`` defaults to stderr; ``tty`` overrides ``stream.isatty()``."""

    def __init__(self, total: int, initial: int = 0, every: int = 10, stream=None, tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.initial, self.every = total, initial, max(1, every)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.last_val, self.fresh_val, self.t0 = None, False, time.perf_counter()
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=self.stream)

    def update(self, rec: dict) -> None:
        """Show optimizer step ``rec["step"]`` (1-based)."""
        if rec.get("val_loss") is not None:
            self.last_val, self.fresh_val = rec["val_loss"], True
        if self.bar is not None:
            post = {"loss": f"{rec['loss']:.3f}"}
            if self.last_val is not None:
                post["val"] = f"{self.last_val:.3f}"
            post["tok_s"] = f"{rec['tokens_per_s']:.0f}"
            self.bar.set_postfix(post)
            self.bar.update(1)
            return
        step = rec["step"]
        if step % self.every and step != self.total and step != self.initial + 1:
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / (step - self.initial) * (self.total - step)
        val = f"  val {self.last_val:.4f}" if self.fresh_val else ""
        print(f"step {step}/{self.total}  loss {rec['loss']:.4f}{val}  tokens/s {rec['tokens_per_s']:,.0f}  "
              f"ETA {format_eta(eta)}", file=self.stream, flush=True)
        self.fresh_val = False

    def close(self) -> None:
        """Close the bar (nothing to do for plain lines)."""
        if self.bar is not None:
            self.bar.close()
