"""When and how native ZeRO reduces gradients (:class:`~zerotron.parallel.data.zero.ZeroSync`'s
:class:`ZeroReduceMixin`): the reduce-scatters of each unit's flat buffers, their window, HSDP's replica
all-reduce, the step's closing sums and the gradient norm over the shards.

What differs between the two runners is only *when* the reductions start:

  plain (``eager``)  gradient hooks launch each unit's reduce-scatter as soon as the unit's
                     gradients are complete, overlapping the rest of backward (``no_sync`` around
                     all but the last micro-batch at stage 1);
  pipeline           after each backward action of the schedule (one micro-batch through one
                     chunk, or a W of a split backward) the runner calls :meth:`ZeroReduceMixin.
                     after_backward` with that chunk's units (stages 2-3; the W pass of stage 3
                     gathers the chunk's blocks first, ``ZeroSync.gather_blocks``); stage 1
                     reduce-scatters everything in :meth:`ZeroReduceMixin.finish_grads`.

On both, at most ``reduce_window`` units' reduce-scatters are in flight: launching one finishes the
oldest beyond the window and frees its full gradient input, so the backward's peak holds the
gradient shards plus a window's full buffers, never a full gradient copy per rank.

The reduce order is the same on every rank of the group: last block .. first block, then the roots
(``ZeroSync._order``). Attributes used (set by ``ZeroSync.__init__``): ``flats``, ``grad_flats``,
``all_flats``, ``stage``, ``group``, ``dp_group``, ``replicate_group``, ``tied_group``, ``tp_group``,
``sequence_parallel``, ``count_tied``, ``eager``, ``n_root``, ``gatherer``, ``offload``, ``copies`` and the
private step state (``_used``, ``_ready``, ``_order``, ``_next``, ``_inflight``, ``_sync``, ``_final``,
``_rep_queue``, ``_rep_work``, ``_shipped``, ``_unit_of``, ``_reduce_dtype``); the offload mixin's
``_wait_reduce`` and ``_ship`` (``zero_offload``)."""
from __future__ import annotations

import contextlib

from zerotron.distributed import comm
from zerotron.parallel.grad_norm import clip_grad_norm

__all__ = ["ZeroReduceMixin"]


class ZeroReduceMixin:
    """The gradient reductions of :class:`~zerotron.parallel.data.zero.ZeroSync` (see the module
    docstring). Class attribute ``reduce_window`` (2): how many units' reduce-scatters may be in
    flight at once (see :meth:`_launch_unit`)."""

    reduce_window = 2

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1 (eager): accumulate full gradients locally without communicating."""
        prev, self._sync = self._sync, self.stage != 1
        try:
            yield
        finally:
            self._sync = prev

    # ---- gradients -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Eager (plain runner), after a synchronised backward: launch whatever was not launched
        (units without gradients), in the fixed order, and wait for all."""
        while self._next < len(self._order):
            self._launch_unit(self._order[self._next])
            self._next += 1
        self._progress_replicate(block=True)
        self._wait_all()
        if self.stage == 3:
            self.gatherer.free_deferred()
        self._next = 0
        for s in self._ready:
            s.clear()

    def after_backward(self, units) -> None:
        """A pipeline, after one backward action that produced weight gradients for ``units`` (its
        chunk's units: the same on every rank of the group, whatever got a gradient): stages 2-3
        reduce-scatter them (in ``reduce_dtype``, the fixed order), accumulate into the shards and
        free the full gradients; stage 3 also frees the gathered blocks. Stage 1: nothing."""
        if self.stage == 1:
            return
        todo = [u for u in self._order if u in units]
        for u in todo:
            self._launch_unit(u)
        self._wait_all()
        if self.stage == 3:
            for u in range(self.n_root, len(self.flats)):
                self.gatherer.free(u)
            self.gatherer.deferred = []

    def finish_grads(self) -> None:
        """Complete the step's reduction: (pipeline) stage 1's reduce-scatters; HSDP's all-reduce
        of each shard gradient across the replicas; the per-parameter "got a gradient" marks summed
        over dp (one small all-reduce, one float per parameter) into each buffer's ``used``; the
        tied shard summed over ``tied_group``; with sequence parallelism the tp-replicated shards
        summed over tp (every sum in ``reduce_dtype``, on the shards: summing compute-dtype full
        gradients would ignore an fp32 reduce dtype). Exposes the shard gradients as
        ``master.grad``; offloaded, the host copies (``host_grad``): those not yet on their way
        (:meth:`_wait_reduce` ships most during backward) are copied now, and every copy is
        waited for, so ``master.grad`` is complete on return."""
        self._used.launch(self.dp_group, self.all_flats[0].master.device)
        flats = self.grad_flats
        if not self.eager:  # a pipeline: no backward action knows it is a unit's last of the step
            self._final = True
            if self.stage == 1:
                for u in self._order:
                    self._launch_unit(u)
            elif self.replicate_group is not None:
                self._rep_queue.extend(flats)
            self._progress_replicate(block=True)
            self._wait_all()
            self._final = False
        # HSDP: the shard group's reduce-scatters summed the gradients of this replica; one
        # all-reduce of each 1/S gradient shard across the replicas completes the dp sum
        for work, buf, t in self._rep_work:
            work.wait()
            if buf is not t:
                t.copy_(buf)
        self._rep_work = []
        flags = self._used.result()
        i = 0
        for f in flats:
            f.used, i = flags[i:i + len(f.params)], i + len(f.params)
        if self.tied_group is not None:  # same flat layout and shard on the first and the last stage
            for f in flats:
                if f.is_tied:
                    comm.all_reduce_in(f.shard_grad, f.reduce_dtype, group=self.tied_group, tag="pp_tied")
        if self.tp_group is not None and self.sequence_parallel:
            # replicated parameters saw only this rank's sequence shard: sum their (dp-reduced)
            # gradient shards over tp (Korthikanti et al. 2022); the flat layouts match across tp
            for f in flats:
                if not f.tp_sharded:
                    comm.all_reduce_in(f.shard_grad, f.reduce_dtype, group=self.tp_group, tag="tp_grad")
        if self.offload:
            for f in flats:
                self._ship(f)
            for f in flats:
                self.copies.wait(self._shipped.get(id(f)))
            self._shipped = {}
        for f in flats:  # offload: the host copy, which the norm, the clip and the step read
            f.master.grad = f.host_grad if f.host_grad is not None else f.shard_grad

    def clip_grad_norm(self, max_norm: float, outer=()) -> float:
        """Global norm from the shards (:func:`zerotron.parallel.grad_norm.clip_grad_norm`): every
        element counted once (padding is zero; tp shards summed over tp, tp-replicated once; the
        tied shard only where ``count_tied``, clipped everywhere), then summed over the shard group
        (with HSDP the replicas hold the same shards and are not summed) and ``outer`` (a pipeline:
        the pp group); identical on every rank. Clips the shard gradients in place: ``master.grad``
        (:meth:`finish_grads`), the device's shards or, offloaded, their host copies."""
        counted = [f for f in self.grad_flats if self.count_tied or not f.is_tied]
        extra = [f.master.grad for f in self.grad_flats if not (self.count_tied or not f.is_tied)]
        parts = [([f.master.grad for f in counted if f.tp_sharded], [self.tp_group]),
                 ([f.master.grad for f in counted if not f.tp_sharded], [])]
        return clip_grad_norm(parts, max_norm, outer=[self.group, *outer], also_clip=extra)
    # ---- hooks -------------------------------------------------------------------------------
    def _on_grad(self, p) -> None:
        self._used.mark(p)
        if not (self.eager and self._sync):
            return
        u = self._unit_of[id(p)]
        self._ready[u].add(id(p))
        while self._next < len(self._order):
            unit = self._order[self._next]
            if len(self._ready[unit]) < sum(len(f.params) for f in self.flats[unit] if not f.frozen):
                return
            self._launch_unit(unit)
            self._next += 1

    def _launch_unit(self, u: int) -> None:
        """Launch unit ``u``'s reduce-scatters (async; stage 3 frees its gathered block). First
        the oldest in flight are finished until fewer than :attr:`reduce_window` units remain,
        which frees their full gradient inputs (the shard outputs accumulate): at any moment a
        rank holds its gradient shards plus the full reduce buffers of at most ``reduce_window``
        units (ZeRO-2's point), while each unit's communication still overlaps the backward of
        the next ``reduce_window - 1`` units. The waits change only when each shard accumulates,
        not what or in which order: the sums are bitwise the same."""
        while len(self._inflight) >= self.reduce_window:
            for f in self.flats[self._inflight.pop(0)]:
                self._wait_reduce(f)
        for f in self.flats[u]:
            f.launch_reduce()
            if self.stage == 3 and u >= self.n_root and not f.frozen:
                f.free()
        if self.stage == 3 and u >= self.n_root and any(f.frozen for f in self.flats[u]):
            self.gatherer.defer_free(u)
        self._inflight.append(u)
        if self.replicate_group is not None and self._final:
            self._rep_queue.extend(f for f in self.flats[u] if not f.frozen)
            self._progress_replicate(block=False)

    def _wait_all(self) -> None:
        """Finish every reduce-scatter in flight (each accumulates into its shard gradient)."""
        for f in self.all_flats:
            self._wait_reduce(f)
        self._inflight = []

    def _progress_replicate(self, block: bool) -> None:
        """HSDP, the step's last reductions: for each queued flat in launch order (the same on every
        rank, so the replica all-reduces match), once its reduce-scatter is done (``block``: wait
        for it), launch the all-reduce of its shard gradient across the replicas (async,
        ``parallel.data.hsdp``); stops at the first still in flight when not ``block``."""
        while self._rep_queue:
            f = self._rep_queue[0]
            if not block and f.pending is not None and not f.pending[0].is_completed():
                return
            f.wait_reduce()
            self._rep_queue.pop(0)
            buf = f.shard_grad if f.shard_grad.dtype == self._reduce_dtype else f.shard_grad.to(self._reduce_dtype)
            work = comm.all_reduce(buf, group=self.replicate_group, async_op=True, tag="grad_rep")
            self._rep_work.append((work, buf, f.shard_grad))
