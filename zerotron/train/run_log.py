"""Rank 0's run files under a failing disk: the metrics.jsonl policy (one warning, records held in
memory and written when an append succeeds again) and summary.json, written atomically whenever
the run ends -- finished, stopped by a guard or a signal, or with a failed save."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .metrics import MetricsWriteError, MetricsWriter, strict_json

__all__ = ["MetricsLog", "write_summary"]


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


class MetricsLog:
    """metrics.jsonl appends of rank 0 with the policy of ``checkpoint.on_error`` (the one setting
    for every run file that cannot be written):

    - an append that fails (disk full, I/O error) leaves no torn line (:class:`MetricsWriter` cuts
      the file back) and the record is held in memory; the next record first writes the held ones;
    - ``continue``: one warning line when appends start failing, one note when they succeed again;
    - ``stop``: no line here; the trainer agrees on :attr:`error` at the next step (one more float
      of the per-step all-reduce of ``lifecycle.StepGuard.decide``) and stops every rank after a
      checkpoint attempt, naming :attr:`error` in its one line.
    """

    def __init__(self, writer: MetricsWriter, on_error: str):
        self.writer, self.on_error = writer, on_error
        self.error: MetricsWriteError | None = None  # the latest failure while records are held
        self.closed = False

    def write(self, record: dict) -> None:
        """Append ``record`` (and any held before it); never raises MetricsWriteError."""
        held = self.writer.held_steps
        try:
            self.writer.write(record)
        except MetricsWriteError as e:
            if self.error is None and self.on_error == "continue":
                print(f"zerotron: warning: {e}; training continues (checkpoint.on_error = continue), the records are "
                      "held in memory until an append succeeds", file=sys.stderr, flush=True)
            self.error = e
            return
        if self.error is not None:
            if self.on_error == "continue":
                print(f"zerotron: metrics.jsonl is written again at step {record.get('step')} (the records of "
                      f"{_span(held)} had been held in memory)", file=sys.stderr, flush=True)
            self.error = None

    def amend(self, extra: dict) -> None:
        """Add ``extra``'s fields to the newest record (:meth:`MetricsWriter.amend`); a failure is
        handled as in :meth:`write` (never raises MetricsWriteError)."""
        try:
            self.writer.amend(extra)
        except MetricsWriteError as e:
            self.error = e

    def held(self) -> str:
        """'step N' / 'steps A-B' of the records not written yet ('' if none)."""
        steps = self.writer.held_steps
        return _span(steps) if steps else ""

    def close(self) -> MetricsWriteError | None:
        """Write what is held and close the file; returns the error if records are left unwritten.
        A second call returns the first one's result."""
        if self.closed:
            return self.error
        self.closed = True
        try:
            self.writer.close()
        except MetricsWriteError as e:
            self.error = e
            return e
        self.error = None
        return None


def write_summary(run_dir: str | Path, summary: dict) -> bool:
    """Write ``run_dir/summary.json`` (strict JSON: non-finite floats as null) through a temporary
    file and a rename, so a full disk leaves the previous summary or none, never a torn one.
    On OSError prints one warning line and returns False."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(strict_json(summary), indent=1, allow_nan=False))
        os.replace(tmp, path)
        return True
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"zerotron: warning: cannot write {path}: {e.strerror or e}", file=sys.stderr, flush=True)
        return False
