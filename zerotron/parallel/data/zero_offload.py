"""Native ZeRO's offload (``train.offload``; ZeRO-Offload, Ren et al. 2021): the copies between
device and host of :class:`~zerotron.parallel.data.zero.ZeroSync` (:class:`ZeroOffloadMixin`).

Each shard gradient leaves for its host buffer on a background copy (``host_copies``) as soon as
its step's last reduction is finished (:meth:`ZeroOffloadMixin._wait_reduce`: during backward for
all but the last units; HSDP's replica sum, the tied and the sequence-parallel sums first complete
in ``finish_grads``, which starts the remaining copies and waits for all); the norm, the clip and
the step run on the host copies. After the step the updated masters go back in the background, in
unit order: stage 3's all-gathers wait for each unit's copy just before they start (the forward's
prefetch included); at stages 1-2 the plain runner defers the all-gathers to the next forward (each
block's pre-hook gathers its own unit and prefetches the next; ``ZeroSync.begin_step`` the roots;
:meth:`ZeroOffloadMixin.settle` anything left, called by every other reader of the parameters); a
pipeline gathers them at the end of the step. Metrics: :meth:`ZeroOffloadMixin.offload_timing`.
The per-buffer side (host buffers, the disk tier) is :class:`~zerotron.parallel.data.flat_shard.FlatShard`'s.

Attributes used (set by ``ZeroSync.__init__``): ``flats``, ``grad_flats``, ``stage``, ``offload``,
``copies``, ``replicate_group``, ``tied_group``, ``tp_group``, ``sequence_parallel``, ``_final``,
``_shipped``, ``_disk_timing``."""
from __future__ import annotations

import torch

from zerotron.parallel.data.flat_shard import FlatShard

__all__ = ["ZeroOffloadMixin"]


class ZeroOffloadMixin:
    """Offload's copies between device and host for :class:`~zerotron.parallel.data.zero.ZeroSync`
    (see the module docstring); every method is a no-op (or plain) without offload."""

    def _wait_reduce(self, f: FlatShard) -> None:
        """Finish ``f``'s reduce-scatter; offloaded, when that was the step's last reduction of its
        shard gradient, start its copy to the host at once (:meth:`_ship`): the copies of the
        units reduced early in backward overlap the backward of the rest."""
        had = f.pending is not None
        f.wait_reduce()
        if had and self.offload and self._final and self._complete_after_reduce(f):
            self._ship(f)

    def _complete_after_reduce(self, f: FlatShard) -> bool:
        """True when nothing adds to ``f``'s shard gradient after its (final) reduce-scatter: no HSDP
        replica sum, no tied-copy sum, no sequence-parallel tp sum (those ship in finish_grads)."""
        return self.replicate_group is None and not (self.tied_group is not None and f.is_tied) and \
            not (self.tp_group is not None and self.sequence_parallel and not f.tp_sharded)

    def _ship(self, f: FlatShard) -> None:
        """Start copying ``f``'s final shard gradient to its host buffer (once per step)."""
        if id(f) not in self._shipped:
            self._shipped[id(f)] = f.grad_to_host(self.copies)

    def _arrive(self, u: int) -> None:
        """Stages 1-2 offload, the plain runner's forward pre-hook of block unit ``u``: all-gather its
        updated parameters (after their host -> device copy) if still due and wait; start the next
        unit's (prefetch). Every rank runs the blocks in the same order, so the gathers match."""
        self._gather_stale(u, wait=True)
        if u + 1 < len(self.flats):
            self._gather_stale(u + 1, wait=False)

    @torch.no_grad()
    def _gather_stale(self, u: int, wait: bool) -> None:
        for f in self.flats[u]:
            if f.stale:
                f.launch_gather()  # waits for the shard's copy from the host first
        if wait:
            for f in self.flats[u]:
                if f.stale:
                    f.wait_gather()
                    f.stale = False

    def settle(self, units=None) -> None:
        """Offload: finish what a step left in flight for ``units`` (default all, in unit order):
        the host -> device copies, and at stages 1-2 the all-gathers of the updated shards.
        Collective over the shard group when an all-gather is still due (every rank calls it at the
        same points). No-op without offload."""
        if not self.offload:
            return
        for u in range(len(self.flats)) if units is None else units:
            if self.stage < 3:
                self._gather_stale(u, wait=False)
        for u in range(len(self.flats)) if units is None else units:
            if self.stage < 3:
                self._gather_stale(u, wait=True)
            for f in self.flats[u]:
                f.settle_arrival()

    def offload_timing(self) -> dict:
        """Offload: seconds since the last call spent copying between device and host on the
        background thread (``offload_copy_s``: gradients out, updated parameters back), seconds the
        training loop waited for those copies (``offload_wait_s``), their ratio hidden
        (``offload_hidden = 1 - wait / copy``, None without a copy); the disk tier adds the I/O
        threads' seconds (``offload_io_s``: reads and writes of the Adam state) and the step's waits
        for them (``offload_io_wait_s``). ``{}`` without offload."""
        if not self.offload:
            return {}
        t = self.copies.timing()
        out = {"offload_copy_s": t["copy_s"], "offload_wait_s": t["wait_s"],
               "offload_hidden": 1 - t["wait_s"] / t["copy_s"] if t["copy_s"] > 0 else None}
        if any(f.disk is not None for f in self.grad_flats):
            out.update(offload_io_s=self._disk_timing["io_s"], offload_io_wait_s=self._disk_timing["io_wait_s"])
            self._disk_timing = {"io_s": 0.0, "io_wait_s": 0.0}
        return out
