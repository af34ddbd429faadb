"""The checkpoint saves of a training run: when the next one is due, the free space a first one
needs, writing now or in the background (``checkpoint.async_save``), and what a failed save (or a
failed metrics.jsonl append) does: a warning, or the exit-3 stop line naming the fix."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import checkpoint as ckpt
from . import lifecycle


class RunSaves:
    """The saves of :class:`~zerotron.train.trainer.Trainer` (a mixin: it uses the attributes
    ``Trainer.__init__`` sets: ``cfg``, ``run_dir``, ``strategy``, ``optimizer``, ``scheduler``, ``saver``, ...)."""

    def expected_checkpoint_bytes(self) -> int:
        """Estimated bytes of a checkpoint, for the free-space check of the first save (later ones
        use the previous checkpoint's size): the dense state dict three times (weights and AdamW's
        two moments), 2 KiB of file and index overhead per saved tensor, the tokenizer, 16 KiB of
        RNG state per rank and 64 KiB for the rest (tiny model: 6% above the real size)."""
        tok = self.data.tokenizer_path
        tok_bytes = os.path.getsize(tok) if tok and os.path.isfile(tok) else 0
        return 3 * self.state_bytes + 3 * 2048 * self.state_tensors + tok_bytes + 16384 * self.world + 65536

    def next_save(self, step: int) -> int | None:
        """The step of the first save after ``step`` (checkpoint.every / save_final), or None."""
        every, steps = self.cfg.checkpoint.every, self.cfg.train.steps
        if every and (step // every + 1) * every <= steps:
            return (step // every + 1) * every
        return steps if self.cfg.checkpoint.save_final and step < steps else None

    def save(self, step: int, must: str = "") -> Path | None:
        """Collectively write checkpoint ``step``; returns its directory. Sets :attr:`ckpt_blocked_s`
        (the seconds this call kept training from going on).

        With ``checkpoint.async_save`` and no ``must``, the state is staged into host memory and
        written by a background thread (``checkpoint.background``); the call first waits for a
        pending save (at most one in flight), whose failure is handled here as below, and returns
        the directory the new checkpoint will have once written. A ``must`` save (and every save
        without ``async_save``) is written before the call returns, after any pending one.

        A save refused by the free-space check or failed while writing (the partial directory is
        removed, the previous checkpoints are kept): with ``checkpoint.on_error = continue`` and no
        ``must``, rank 0 prints one warning line, the step is recorded in :attr:`failed_saves`
        (:attr:`unsaved` until a later save succeeds) and None is returned on every rank (the
        failure is agreed collectively, so all ranks go on together). Otherwise, or when ``must``
        says why this save cannot be skipped ("final": the end of training; "signal": a stop on a
        signal), raises lifecycle.RunStopped (exit 3) on every rank. A non-finite parameter
        always raises RunStopped."""
        t0 = time.perf_counter()
        self.ckpt_blocked_s = 0.0
        try:
            self.finish_pending()
            if not lifecycle.params_finite(self.strategy, self.device):
                raise lifecycle.RunStopped(f"refusing to write checkpoint step_{step}: a parameter is not finite; "
                                           f"the newest good checkpoint is {ckpt.latest_checkpoint(self.run_dir)}")
            args = (self.run_dir, step, self.strategy, self.optimizer, self.scheduler, self.meta(step),
                    self.data.tokenizer_path)
            opts = {"keep": self.cfg.checkpoint.keep, "expected_bytes": self.expected_checkpoint_bytes()}
            if self.saver is not None and not must:
                self.saver.start(*args, **opts)
                return self.run_dir / "checkpoints" / f"step_{step}"
            try:
                path = ckpt.save_checkpoint(*args, **opts)
                self.unsaved = None
                return path
            except ckpt.CheckpointWriteError as e:
                return self._save_failed(step, must, e)
        finally:
            self.ckpt_blocked_s = time.perf_counter() - t0

    def finish_pending(self) -> Path | None:
        """Wait for the pending background save (``checkpoint.async_save``), if any; returns its
        directory, or None when there was none or it failed (handled as :meth:`save` handles a
        failed save without ``must``: a warning, or RunStopped with ``on_error = stop``)."""
        if self.saver is None or not self.saver.pending:
            return None
        step = self.saver.pending_step
        path, err, _ = self.saver.wait()
        if err is None:
            self.unsaved = None
            return path
        if isinstance(err, ckpt.CheckpointWriteError):
            return self._save_failed(step, "", err)
        raise err

    def _save_failed(self, step: int, must: str, e: Exception) -> None:
        """The outcome of a failed save of ``step`` (see :meth:`save`): None, or RunStopped."""
        self.failed_saves.append(step)  # (summary.json lists it also when the run stops here)
        if must or self.cfg.checkpoint.on_error == "stop":
            why = {"final": f"the final checkpoint (step {step} of {self.cfg.train.steps}) could not be written",
                   "signal": "the run was stopping on a signal",
                   "metrics": f"{self._metrics_error()} (checkpoint.on_error = stop)"
                   }.get(must, "checkpoint.on_error = stop")
            cks = ckpt.list_checkpoints(self.run_dir)
            newest, lost = bool(cks), step - (cks[-1][0] if cks else 0)
            raise lifecycle.RunStopped(f"{e}; stopped: {why}; the last {lost} steps are not saved; free disk "
                                       f"space, then " + (f"resume with: {lifecycle.resume_command()}" if newest
                                                          else self._start_again())) from None
        self.unsaved = step
        if self.rank == 0:
            nxt = self.next_save(step)
            print(f"zerotron: warning: {e}; training continues (checkpoint.on_error = continue), "
                  + (f"the next save at step {nxt} retries" if nxt else "no later save is scheduled"),
                  file=sys.stderr, flush=True)
        return None

    def _log_blocked(self, writer) -> None:
        """Add ``ckpt_blocked_s`` (and ``ckpt_async``) of the save just made to the step's record
        in metrics.jsonl (rank 0)."""
        if writer is not None:
            writer.amend({"ckpt_blocked_s": self.ckpt_blocked_s,
                          "ckpt_async": self.saver is not None and self.saver.pending})

    def _metrics_error(self) -> str:
        """What failed on rank 0's metrics.jsonl (the line only rank 0 prints)."""
        log = getattr(self, "metrics_log", None)
        return str(log.error) if log is not None and log.error is not None else "metrics.jsonl could not be written"

    def _start_again(self) -> str:
        """The fix for a run that stopped without any checkpoint: its metrics.jsonl stays, so the same
        --run-dir is refused (``setup.check_run_dir``); a new one, or this one deleted, starts over."""
        return f"start again with a new --run-dir (or delete {str(self.run_dir)!r} first)"

    def _metrics_stop(self, step: int, saved: Path) -> lifecycle.RunStopped:
        """The exit-3 stop after a failed metrics.jsonl append (checkpoint.on_error = stop), once
        checkpoint ``saved`` of ``step`` is written."""
        log, what = getattr(self, "metrics_log", None), self._metrics_error()
        if log is not None:
            log.close()  # the held records, if the checkpoint attempt left room for them
        held = log.held() if log is not None else ""
        lost = f"; the records of {held} are not in metrics.jsonl" if held else ""
        if step == self.cfg.train.steps:  # nothing left to resume
            return lifecycle.RunStopped(f"{what}; training finished at step {step} and its checkpoint is written "
                                        f"({saved}), but metrics.jsonl could not be written (checkpoint.on_error = "
                                        f"stop){lost}")
        return lifecycle.RunStopped(f"{what}; stopped at step {step} (checkpoint.on_error = stop), "
                                    f"checkpoint written ({saved}){lost}; free disk space, then resume with: "
                                    f"{lifecycle.resume_command()}")
