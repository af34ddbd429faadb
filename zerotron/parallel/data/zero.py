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
  stage 3  parameters sharded at rest: each block's flat parameters are all-gathered just before
           its forward and again before its backward and freed right after, the next block's
           prefetched; the root unit is gathered once per step (``zero_gather``: the rules).

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
parameters, then each block of its chunks). What differs is only *when* the reductions start
(``zero_reduce``: gradient hooks on the plain runner, the schedule's backward actions on a
pipeline); on both at most ``ZeroSync.reduce_window`` units' reduce-scatters are in flight.

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

Offload (``train.offload``; ZeRO-Offload, Ren et al. 2021): gradients leave for the host during
backward, the step runs on the host and the updated masters come back in the background
(``zero_offload``; per buffer, ``flat_shard``). Metrics: :meth:`ZeroSync.offload_timing`.

Mixed precision (``train.dtype = "bf16"``): module parameters (compute copies) are bf16, master
shards and Adam state fp32; gradients are reduced in ``parallel.reduce_dtype`` (fp32 by default).

The code, by concern: this module (construction, the optimizer's view and step, the plain runner's
:class:`ZeroStrategy`); ``zero_reduce`` (the gradient reductions); ``zero_gather`` (stage 3's
parameters); ``zero_offload`` (copies between device and host); ``zero_state`` (checkpoint state);
``flat_shard`` / ``flat_units`` (one flat buffer; the buffers of the units and their bytes).
"""
from __future__ import annotations

import contextlib

import torch

from zerotron.parallel import precision
from zerotron.parallel.base import Strategy, post_accumulate_hooks
from zerotron.parallel.data.disk_state import disk_step, rank_state_dir
from zerotron.parallel.data.flat_shard import FlatShard
from zerotron.parallel.data.flat_units import build_flats, flat_state_bytes
from zerotron.parallel.data.host_copies import HostCopies
from zerotron.parallel.data.used import UsedMarks
from zerotron.parallel.data.zero_gather import UnitGatherer, ZeroGatherMixin
from zerotron.parallel.data.zero_offload import ZeroOffloadMixin
from zerotron.parallel.data.zero_reduce import ZeroReduceMixin
from zerotron.parallel.data.zero_state import ZeroStateMixin
from zerotron.parallel.optim import build_optimizer, decay_mask

__all__ = ["ZeroSync", "ZeroStrategy"]


class ZeroSync(ZeroReduceMixin, ZeroOffloadMixin, ZeroGatherMixin):
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
    reduce-scatters may be in flight at once (``zero_reduce``). Attributes: ``flats`` (per unit, its FlatShards),
    ``all_flats`` (every buffer), ``grad_flats`` (the trainable ones: gradients, optimizer), ``group``,
    ``stage``, ``gatherer``. Raises ValueError for a bad stage or dtype."""

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
        with rank_state_dir(offload_dir) if offload == "optimizer-disk" else contextlib.nullcontext() as disk_dir:
            self.flats: list[list[FlatShard]] = build_flats(units, names, mask, stage, group, compute, reduce, tied,
                                                                 offload, group_of, disk_dir)
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

    def zero_grad(self) -> None:
        self._used.reset()
        for f in self.all_flats:
            f.zero_grad()
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
        """Bytes held now (:func:`~zerotron.parallel.data.flat_units.flat_state_bytes`)."""
        return flat_state_bytes(self.all_flats, optimizer)



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
