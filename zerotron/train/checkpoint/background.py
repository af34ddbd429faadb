"""Asynchronous checkpoints (``checkpoint.async_save``): the state is staged into host memory (a
copy, :func:`.save.stage_checkpoint` with ``copy_state``), training resumes, and a background thread
writes it with :func:`.save.write_checkpoint` -- the same ``.tmp_step_<N>`` directory, checksums,
meta.json, atomic rename and rotation as a synchronous save, so a process killed during the
background write (even ``kill -9``) leaves the previous checkpoint as the newest one.

Every collective of the background write (DCP's own, the error agreement, the checksum gather,
the barriers) runs on a gloo process group made for checkpoints only, so it never interleaves with
the training thread's collectives on the other groups. At most one save is in flight: starting
the next one first waits for the pending one (the same rule as torchtitan's async DCP mode).

A strategy whose checkpoint state is gathered across ranks (native ZeRO: each dp rank holds a
shard) offers ``checkpoint_snapshot``: the foreground then only copies this rank's shards into host
buffers, and the background thread gathers them into the canonical state before writing, over
stand-ins of the strategy's groups (``checkpoint_groups``: the same ranks, gloo groups made for
checkpoints when the saver is built), so the gather leaves the training thread too.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch.distributed as dist

from zerotron.distributed.groups import NamedGroup, group_ranks, new_group
from zerotron.distributed.watchdog import unwatched

from .save import stage_checkpoint, write_checkpoint


def stand_in_groups(groups: list) -> dict:
    """``{id(group): NamedGroup}``: for each of ``groups`` (NamedGroups; this rank's, any number) a
    new gloo group with the same global ranks, named ``ckpt_<name>``. Collective over the world:
    every rank's rank lists are gathered and every distinct one is created in the same order on
    all ranks (``new_group`` must be called by every rank)."""
    mine = [tuple(group_ranks(g)) for g in groups]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    made = {t: new_group(list(t), backend="gloo") for t in sorted({t for lst in every for t in lst})}
    return {id(g): NamedGroup(made[t], f"ckpt_{g.name}") for g, t in zip(groups, mine)}


class AsyncSaver:
    """One background checkpoint writer per run (every rank builds one, collectively: the
    constructor creates the checkpoint process group, and for a ``strategy`` with
    ``checkpoint_snapshot`` the stand-ins of its ``checkpoint_groups``).

    :meth:`start` stages and launches a save and returns the seconds the caller was blocked
    (waiting for the previous save, then staging); :meth:`wait` blocks until the pending save
    is done and returns ``(path, error, seconds waited)`` of that save (``path`` None when it
    failed; ``error`` the CheckpointWriteError (or other exception) it raised on this rank)."""

    def __init__(self, strategy=None):
        self.group = new_group(backend="gloo") if dist.is_initialized() else None
        self.stand_ins = None  # {id(group): stand-in}: the snapshot's gathers run in the background
        if getattr(strategy, "checkpoint_snapshot", None) is not None and dist.is_initialized():
            self.stand_ins = stand_in_groups(strategy.checkpoint_groups())
        self._thread: threading.Thread | None = None
        self._result: tuple[Path | None, BaseException | None] = (None, None)
        self.pending_step: int | None = None
        self._buffers: dict = {}  # host staging buffers, reused by the next save (after the pending one)

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._thread is not None

    def start(self, run_dir, step: int, strategy, optimizer, scheduler, meta: dict, tokenizer_path=None,
              keep: int = 0, expected_bytes: int | None = None) -> float:
        """Collectively stage checkpoint ``step`` into host memory and write it in the background
        (all ranks must call). Must not be called while a save is pending (:meth:`wait` first: its
        outcome belongs to the caller). Returns the seconds spent staging."""
        if self._thread is not None:
            raise RuntimeError("AsyncSaver.start: a save is pending; call wait() first")
        t0 = time.perf_counter()
        staged = stage_checkpoint(step, strategy, optimizer, scheduler, meta, copy_state=True, buffers=self._buffers,
                                  defer=self.stand_ins is not None)
        self._result = (None, None)

        def run():
            try:
                with unwatched():
                    if staged.finish is not None:  # the gather of the snapshot, on the stand-in groups
                        msd, osd = staged.finish(self.stand_ins)
                        staged.state, staged.finish = {"model": msd, "optim": osd}, None
                    self._result = (write_checkpoint(run_dir, staged, tokenizer_path, keep, expected_bytes,
                                                     group=self.group), None)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                self._result = (None, e)

        self.pending_step = step
        self._thread = threading.Thread(target=run, name=f"zerotron-ckpt-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def wait(self) -> tuple[Path | None, BaseException | None, float]:
        """Block until the pending save (if any) is written; ``(path, error, seconds waited)``.
        Without a pending save: ``(None, None, 0.0)``."""
        if self._thread is None:
            return None, None, 0.0
        t0 = time.perf_counter()
        self._thread.join()
        self._thread, self.pending_step = None, None
        path, err = self._result
        self._result = (None, None)
        return path, err, time.perf_counter() - t0
