"""ZeRO stages 1, 2 and 3 over the dp dimension, built from reduce-scatter and all-gather.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".

Storage. Parameters are grouped into *units* -- the root (token/position embeddings, the tied LM
head, the final LayerNorm) and each transformer block -- and, inside a unit, by weight-decay flag, so
every flat buffer holds parameters with one AdamW setting (the decay mask of each original parameter
is kept although storage is flat). Each flat buffer of ``n`` elements is padded to
``ceil(n / dp) * dp``; dp rank r owns the shard ``[r*k, (r+1)*k)``, ``k = padded / dp``. The optimizer
(torch AdamW) sees one fp32 *master* shard per flat buffer, so Adam's math and step counters are the
same as for the unsharded parameters.

  stage 1  optimizer state sharded. Full gradients accumulate locally (views into a flat buffer);
           after the last micro-batch each flat buffer is reduce-scattered (launched from gradient
           hooks as soon as its unit is complete, overlapping the rest of backward); each rank
           updates its shard; updated parameters are all-gathered.
  stage 2  gradients sharded too: every micro-batch's gradients are reduce-scattered unit by unit
           during backward and accumulated into the fp32 shard; full gradients are freed as soon
           as they are reduced.
  stage 3  parameters sharded at rest: a block's flat parameters are all-gathered just before its
           forward and again before its backward and freed (storage resized to 0) right after; the
           next block's all-gather is prefetched asynchronously so communication overlaps compute:
           forward prefetches the block that followed this one in the previous forward (i+1 the
           first time), backward the block whose forward ran just before. Any module order is safe
           (skipped, reordered, data-dependent blocks -- the same on every dp rank, as collectives
           must match): a unit is always gathered and waited for before use, a prefetched unit that
           does not run is waited for before its storage is released, and nothing gathered outlives
           the step. The root unit is gathered once per step and kept until the step's gradients
           are reduced (it is used at both ends of the model); a pipeline gathers its root units
           for the step (:meth:`ZeroSync.begin_step` .. :meth:`ZeroSync.end_step`).

Parameters without gradient. Hooks mark each parameter that got a gradient in the step; the marks
are summed over dp in one small all-reduce per step (one float per parameter). A parameter no dp
rank used is skipped as torch's AdamW skips a grad-None parameter on one process: a flat buffer
nobody used is left out of the step; a buffer used in part (or whose parameters have taken
different numbers of steps) is updated parameter by parameter, each with its own step count
(``FlatShard.adamw_step``), so the unused elements' value, moments and step stay untouched.
Checkpoints carry the per-parameter steps (no state for a parameter never stepped, as in torch).

Communication per step, in nccl-tests "size" bytes (per-rank traffic = size x (n-1)/n), with
Psi = padded parameter count and e = bytes per element:
  stage 1: reduce-scatter Psi*e + all-gather Psi*e            (= 2 Psi, like an all-reduce)
  stage 2: reduce-scatter A*Psi*e + all-gather Psi*e          (A = micro-batches per step)
  stage 3: all-gather (2A*Psi_blocks + Psi_root)*e + reduce-scatter A*Psi*e   (~3 Psi when A = 1)

One driver for both runners. :class:`ZeroSync` is the gradient synchroniser over any list of
*units* (root units first, then blocks): the plain runner's :class:`ZeroStrategy` hands it the whole
model (units: the non-block parameters, then each block), a pipeline rank
(``pipeline.runner.PipelineStrategy``) its stages (units: the tied weight alone, the other non-block
parameters, then each block of its chunks). What differs is only *when* the reductions start:

  plain (``eager``)  gradient hooks launch each unit's reduce-scatter as soon as the unit's
                     gradients are complete, overlapping the rest of backward (``no_sync`` around
                     all but the last micro-batch at stage 1);
  pipeline           after each backward action of the schedule (one micro-batch through one
                     chunk, or a W of a split backward) the runner calls :meth:`ZeroSync.
                     after_backward` with that chunk's units (stages 2-3; the W pass of stage 3
                     gathers the chunk's blocks first, :meth:`ZeroSync.gather_blocks`); stage 1
                     reduce-scatters everything in :meth:`ZeroSync.finish_grads`.

On both, at most ``ZeroSync.reduce_window`` units' reduce-scatters are in flight: launching one
finishes the oldest beyond the window and frees its full gradient input, so the backward's peak
holds the gradient shards plus a window's full buffers, never a full gradient copy per rank.

Everything else is the same code on both: used-parameter marks, HSDP's replica all-reduce of the
shard gradients, the tied-shard sum between a pipeline's first and last stage (``tied_group``), the
sequence-parallel tp sums, the per-parameter AdamW of partly used buffers, the gradient norm over
the shards and the model-state bytes.

Frozen parameters (LoRA: ``requires_grad = False``). They live in their own flat buffers
(``FlatShard.frozen``): sharded at stage 3 and gathered for compute like every parameter, but with no
gradient, no reduce-scatter, no used-parameter mark and no optimizer state (:attr:`ZeroSync.grad_flats`
are the trainable buffers, :attr:`ZeroSync.all_flats` every buffer: the model state). A unit counts
as complete when its trainable parameters have their gradients; at stage 3 its frozen buffers can
still be needed by the rest of the unit's backward (the input gradient through a frozen weight), so
they are freed at the next unit's pre-backward gather (``UnitGatherer.defer_free``), not then.

Offload (``train.offload``, ``FlatShard``; ZeRO-Offload, Ren et al. 2021). Each shard gradient leaves
for its host buffer on a background copy (``host_copies``) as soon as its step's last reduction is
finished (:meth:`ZeroSync._wait_reduce`: during backward for all but the last units; HSDP's replica
sum, the tied and the sequence-parallel sums first complete in ``finish_grads``, which starts the
remaining copies and waits for all); the norm, the clip and the step run on the host copies. After
the step the updated masters go back in the background, in unit order: stage 3's all-gathers wait for
each unit's copy just before they start (the forward's prefetch included); at stages 1-2 the plain
runner defers the all-gathers to the next forward (each block's pre-hook gathers its own unit and
prefetches the next; :meth:`ZeroSync.begin_step` the roots; :meth:`ZeroSync.settle` anything left,
called by every other reader of the parameters); a pipeline gathers them at the end of the step.
Metrics: :meth:`ZeroSync.offload_timing`.

Mixed precision (``train.dtype = "bf16"``): module parameters (compute copies) are bf16, master
shards and Adam state fp32; gradients are reduced in ``parallel.reduce_dtype`` (fp32 by default).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from zerotron.config import ConfigError
from zerotron.distributed import comm
from zerotron.parallel import precision
from zerotron.parallel.base import Strategy, post_accumulate_hooks
from zerotron.parallel.data.disk_state import disk_step, state_files_refusal
from zerotron.parallel.data.flat_shard import FlatShard, build_flats, flat_state_bytes
from zerotron.parallel.data.host_copies import HostCopies
from zerotron.parallel.data.used import UsedMarks
from zerotron.parallel.data.zero_gather import UnitGatherer
from zerotron.parallel.data.zero_state import ZeroStateMixin
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.optim import build_optimizer, decay_mask

__all__ = ["ZeroSync", "ZeroStrategy"]


class ZeroSync:
    """Native ZeRO stage 1/2/3 gradient synchroniser over ``units`` (lists of Parameters: the
    ``n_root`` root units first, then one per block); see the module docstring.

    Args: ``units``; ``names`` (``{id(param): FQN}``, the canonical state's keys); ``mask``
    (``{id(param): decay?}``); ``group`` (the shard group, a ``comm.NamedGroup``: dp, or with HSDP
    dp_shard); ``stage`` (1, 2, 3); ``dtype`` ("fp32" | "bf16" | "fp64": compute copies; see
    ``parallel.precision``), ``reduce_dtype`` ("auto" | "fp32" | "bf16" | "fp64"); ``blocks`` (the
    block modules of units ``n_root..``, for stage 3's gather hooks); ``tp_group`` and
    ``sequence_parallel`` (sum the tp-replicated shard gradients over tp); ``replicate_group`` (HSDP,
    ``parallel.dp_replicate > 1``: the shard gradients are all-reduced over it once per step,
    ``parallel.data.hsdp``); ``dp_group`` (the whole dp group, for the used-parameter marks; default
    ``group``); ``tied`` (a pipeline's tied Parameter, alone in its unit, or None) and ``tied_group``
    (its shard gradient is summed over it: a pipeline's first and last stage); ``count_tied`` (False
    on a rank whose tied copy the norm counts elsewhere); ``eager`` (True: gradient hooks launch the
    reductions unit by unit during backward, the plain runner; False: the runner calls
    :meth:`after_backward`, a pipeline); ``offload`` (``train.offload``: "none" or "optimizer", master
    shards and Adam state in host memory, the step on the host: ``flat_shard.FlatShard``); ``group_of``
    (``{id(param): group}``: parameters sharded over a sub-group of ``group`` instead -- expert
    parallelism's expert parameters over dp/ep, ``parallel.expert``; their flats reduce-scatter and
    all-gather over it, and the norm still sums every shard over ``group``, in which the shards of
    both sets are disjoint); "optimizer-disk": the same as "optimizer" in memory-mapped files under
    ``offload_dir/rank-<global rank>`` (``disk_state``). Class attribute ``reduce_window`` (2): how many units'
    reduce-scatters may be in flight at once (see :meth:`_launch_unit`). Attributes: ``flats`` (per unit, its FlatShards),
    ``all_flats`` (every buffer), ``grad_flats`` (the trainable ones: gradients, optimizer), ``group``,
    ``stage``, ``gatherer``. Raises ValueError for a bad stage or dtype."""

    reduce_window = 2

    def __init__(self, units: list, names: dict, mask: dict, group, stage: int, dtype: str = "fp32",
                 reduce_dtype: str = "auto", *, n_root: int = 1, blocks=(), tp_group=None,
                 sequence_parallel: bool = False, replicate_group=None, dp_group=None, tied=None,
                 tied_group=None, count_tied: bool = True, eager: bool = True, offload: str = "none",
                 group_of: dict | None = None, offload_dir: str = ""):
        if stage not in (1, 2, 3):
            raise ValueError(f"parallel.zero_stage must be 1, 2 or 3 for native ZeRO, got {stage}")
        compute, reduce = precision.compute_dtype(dtype), precision.reduce_dtype(dtype, reduce_dtype)
        self.group, self.stage, self.dp_group = group, stage, dp_group or group
        self.replicate_group, self._reduce_dtype = replicate_group, reduce
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.tied_group, self.count_tied, self.eager, self.n_root = tied_group, count_tied, eager, n_root
        disk_dir, made = None, False
        try:
            if offload == "optimizer-disk":
                disk_dir = os.path.join(offload_dir, f"rank-{dist.get_rank() if dist.is_initialized() else 0}")
                made = not os.path.isdir(disk_dir)
                os.makedirs(disk_dir, exist_ok=True)
            self.flats: list[list[FlatShard]] = build_flats(units, names, mask, stage, group, compute, reduce, tied,
                                                                 offload, group_of, disk_dir)
        except OSError as e:  # the disk tier's folder filled or turned read-only after the launcher's check
            if disk_dir is None:
                raise
            raise ConfigError(state_files_refusal(offload_dir, disk_dir, e)) from None
        finally:
            if made:  # every file is unlinked once mapped (or on failure): drop the folder we made
                try:
                    os.rmdir(disk_dir)
                except OSError:
                    pass
        self.all_flats = [f for fl in self.flats for f in fl]
        self.grad_flats = [f for f in self.all_flats if not f.frozen]
        self._unit_of = {id(p): u for u, fl in enumerate(self.flats) for f in fl for p in f.params}
        self._used = UsedMarks([p for f in self.grad_flats for p in f.params])
        self._ready = [set() for _ in self.flats]
        # reduce order, the same on every rank of the group: last block .. first block, then the roots
        self._order = list(range(len(self.flats) - 1, n_root - 1, -1)) + list(range(n_root))
        self._next = 0
        self._inflight: list[int] = []  # units whose reduce-scatters are out, oldest first
        self._sync = True
        self._final = eager  # reductions now are the step's last (HSDP: then they go across replicas)
        self._rep_queue: list = []  # HSDP: flats whose last shard-group reduce-scatter is out
        self._rep_work: list = []  # HSDP: (work, buffer, shard_grad) of the replica all-reduces in flight
        self._hooks = post_accumulate_hooks([p for f in self.grad_flats for p in f.params], self._on_grad)
        self.gatherer = UnitGatherer(self.flats, n_root)  # stage 3: gather before use, free after
        if stage == 3:
            self.gatherer.register(blocks)
        self.offload = any(f.offload for f in self.grad_flats)
        self.copies = HostCopies(self.all_flats[0].full.device) if self.offload else None
        self._shipped: dict = {}  # id(flat) -> Future of its gradient's copy to the host (this step)
        self._disk_timing = {"io_s": 0.0, "io_wait_s": 0.0}
        if self.offload and stage < 3 and eager:  # each block waits for its own updated parameters
            for u, b in enumerate(blocks, start=n_root):
                b.register_forward_pre_hook(lambda module, args, u=u: self._arrive(u))

    # ---- the optimizer's view ----------------------------------------------------------------
    def parameters(self) -> list:
        """The fp32 (fp64) master shards, one per flat buffer: what the optimizer steps."""
        return [f.master for f in self.grad_flats]

    def build_optimizer(self, tcfg, mask: dict | None = None):
        """AdamW over the master shards; decay flags were fixed per flat buffer at construction
        (``mask`` is ignored); the kernel is ``train.optimizer_impl``'s (whole flat shards, so
        "fused" steps a handful of large tensors). Offloaded masters (host tensors) with
        ``optimizer_impl = loop`` step with torch's multi-tensor (foreach) AdamW instead, as before
        the field existed. Buffers used only in part step per parameter (:meth:`optimizer_step`)."""
        opt = build_optimizer(self.parameters(), {id(f.master): f.decay for f in self.all_flats}, tcfg)
        if any(f.offload for f in self.all_flats):
            for g in opt.param_groups:
                if not g.get("fused"):
                    g["foreach"] = True
        return opt

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1 (eager): accumulate full gradients locally without communicating."""
        prev, self._sync = self._sync, self.stage != 1
        try:
            yield
        finally:
            self._sync = prev

    def zero_grad(self) -> None:
        self._used.reset()
        for f in self.all_flats:
            f.zero_grad()

    # ---- stage 3 parameters --------------------------------------------------------------------
    def begin_step(self) -> None:
        """Stage 3: gather the root units for the step (used at both ends of the model). Stages
        1-2 with offload: the plain runner waits here for the root units' updated parameters (each
        block waits for its own in its forward, :meth:`_arrive`), a pipeline for every unit's."""
        if self.stage == 3:
            self.gatherer.gather_roots()
        elif self.offload:
            self.settle(range(self.n_root) if self.eager else None)

    def end_step(self) -> None:
        """Stage 3: nothing gathered (or still gathering) survives the step."""
        if self.stage == 3:
            self.gatherer.release_all()

    def gather_blocks(self, units) -> None:
        """Stage 3: all-gather the block units among ``units`` (a W of a split backward reads the
        weights: saved tensors, recomputation); :meth:`after_backward` frees them. Else nothing."""
        if self.stage == 3:
            for u in units:
                if u >= self.n_root:
                    self.gatherer.gather(u)

    @contextlib.contextmanager
    def full_params(self, blocks: bool = True):
        """Stage 3: the root units (and every block when ``blocks``; otherwise the blocks' forward
        hooks gather them one at a time) gathered for the context (evaluation, generation, export,
        state dicts); freed on exit. Stages 1-2: nothing to do (parameters are full at rest) but
        to wait for the updated parameters of an offloaded step (:meth:`settle`)."""
        self.settle()
        if self.stage == 3:
            for u in range(len(self.flats) if blocks else self.n_root):
                self.gatherer.gather(u)
            self.gatherer.hold += blocks  # everything gathered: forwards (e.g. generate) keep it
        try:
            yield
        finally:
            if self.stage == 3:  # also blocks a gradient-free forward prefetched but did not run
                self.gatherer.hold -= blocks
                self.gatherer.release_all()

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

    def optimizer_step(self, optimizer) -> None:
        """AdamW on the master shards, then (stages 1-2) all-gather the updated parameters.

        A parameter that no dp rank used in this step is skipped exactly as torch's optimizer
        skips a grad-None parameter on one process: a buffer nobody used is left out
        (``master.grad = None``); a buffer used in part, or whose parameters' step counts
        differ, is updated per parameter (:meth:`FlatShard.adamw_step`). Otherwise torch's AdamW.
        Offload: the step runs on the host masters (their gradients arrived in :meth:`finish_grads`;
        the disk tier streams its state through :func:`disk_step`); the updated masters go back to
        the device in the background, in unit order (:meth:`FlatShard.send_to_device`): stage 3's
        all-gathers wait for each unit's copy right before they start, stages 1-2's all-gathers are
        left to the next forward (each block's, :meth:`_arrive`; the roots' in :meth:`begin_step`;
        anything else that reads the parameters first calls :meth:`settle`)."""
        self.settle()  # a copy or all-gather the last forward did not need
        for f in self.grad_flats:
            if f.master.grad is None or (f.steps is None and all(f.used)):
                continue
            if any(f.used):
                f.adamw_step(optimizer)
                f.release_disk()
            f.master.grad = None  # left out of optimizer.step()
        # the disk tier streams its state chunk by chunk through I/O threads (disk_state.disk_step)
        on_disk = [(f, f.master.grad) for f in self.grad_flats if f.disk is not None and f.master.grad is not None]
        for f, _ in on_disk:
            f.master.grad = None
        optimizer.step()
        if on_disk:
            for f, _ in on_disk:
                f.init_state(optimizer.state[f.master])
            t = disk_step(optimizer, [(f.master, grad, f.disk) for f, grad in on_disk])
            for k in self._disk_timing:
                self._disk_timing[k] += t[k]
        if self.offload:
            for f in self.grad_flats:  # in unit order: the order the next forward needs them
                f.send_to_device(self.copies)
                f.stale = self.stage < 3
            if not self.eager and self.stage < 3:  # a pipeline gathers here (its stages have no unit hooks)
                self.settle()
            return
        if self.stage < 3:  # frozen buffers did not change
            with torch.no_grad():
                for f in self.grad_flats:
                    f.launch_gather()
                for f in self.grad_flats:
                    f.wait_gather()

    def model_state_bytes(self, optimizer) -> dict:
        """Bytes held now (:func:`~zerotron.parallel.data.flat_shard.flat_state_bytes`)."""
        return flat_state_bytes(self.all_flats, optimizer)

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

    # ---- offload: copies between device and host -----------------------------------------------
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


class ZeroStrategy(ZeroStateMixin, ZeroSync, Strategy):
    """The plain runner with native ZeRO stage 1/2/3 over the whole model: :class:`ZeroSync` over
    the units "parameters outside the blocks", then each block of ``model.layout().blocks``, its
    reductions launched by gradient hooks during backward.

    Args: ``model`` (identically initialised on every rank), ``group`` (dp NamedGroup; with HSDP the
    shard group), ``stage`` (1, 2 or 3), ``dtype``, ``reduce_dtype``, ``mask`` (decay flag by
    ``id(param)``, default ``optim.decay_mask(model)``), ``tp_group``, ``sequence_parallel``,
    ``replicate_group`` (HSDP) and ``dp_group`` (HSDP: the whole dp group, for losses and the
    used-parameter marks; default ``group``), ``offload`` and ``offload_dir``, as :class:`ZeroSync`; ``exclude``: ids
    of parameters left out of the flat buffers (expert parallelism keeps the expert-local ones
    itself under DDP) and ``group_of`` (as :class:`ZeroSync`: expert parallelism's expert parameters
    sharded over dp/ep). Raises ValueError for a bad stage or dtype."""

    def __init__(self, model, group, stage: int, dtype: str = "fp32", reduce_dtype: str = "auto", mask=None,
                 tp_group=None, sequence_parallel: bool = False, replicate_group=None, dp_group=None,
                 offload: str = "none", exclude=frozenset(), group_of: dict | None = None, offload_dir: str = ""):
        blocks = list(model.blocks())
        in_block = {id(p) for b in blocks for p in b.parameters()}
        names = {}
        for n, p in model.named_parameters():  # first FQN of each (tied) parameter
            names.setdefault(id(p), n)
        units = [[p for p in model.parameters() if id(p) not in in_block and id(p) not in exclude]] + \
            [[p for p in b.parameters() if id(p) not in exclude] for b in blocks]
        ZeroSync.__init__(self, units, names, mask or decay_mask(model), group, stage, dtype, reduce_dtype,
                          n_root=1, blocks=blocks, tp_group=tp_group, sequence_parallel=sequence_parallel,
                          replicate_group=replicate_group, dp_group=dp_group, eager=True, offload=offload,
                          group_of=group_of, offload_dir=offload_dir)
        self.module, self.loss_groups = model, [self.dp_group]
        self._in_step = False

    def __call__(self, *args, **kwargs):
        if not self._in_step:
            self.settle()  # offload: the last step's parameters, before a forward outside a step
        if self.stage != 3 or self._in_step:
            return self.module(*args, **kwargs)
        self.gatherer.new_forward()
        with self.full_params(blocks=False):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def full_params(self, blocks: bool = True):
        """:meth:`ZeroSync.full_params`, yielding the model."""
        with ZeroSync.full_params(self, blocks):
            yield self.module

    def forward_backward(self, micro_batches, n_global, dtype, device):
        self.begin_step()
        self._in_step = True
        try:
            total = torch.zeros((), dtype=torch.float64)
            for i, mb in enumerate(micro_batches):
                self._final = i == len(micro_batches) - 1
                self.gatherer.new_forward()
                with self.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    total += Strategy.forward_backward(self, [mb], n_global, dtype, device)
                    if self._sync:
                        self.flush()
        finally:
            self.settle()  # offload: units the forward did not run (their gathers, in unit order)
            self._in_step = False
            self.end_step()  # nothing gathered (or still gathering) survives the step
        return total
