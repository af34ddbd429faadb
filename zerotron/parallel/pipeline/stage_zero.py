"""ZeRO stages 1-3 for one pipeline rank's stages (pipeline x ZeRO over dp); see :class:`StageZero`."""
from __future__ import annotations

import contextlib

import torch

from zerotron.distributed import comm
from zerotron.parallel import precision
from zerotron.parallel.base import unique_params
from zerotron.parallel.data.flat_shard import build_flats
from zerotron.parallel.data.zero_gather import UnitGatherer

__all__ = ["StageZero"]


class StageZero:
    """ZeRO stage 1, 2 or 3 over the dp group for the parameters of one pipeline rank's stages
    (Rajbhandari et al. 2020), built from ``data.flat_shard.FlatShard``.

    Units: the tied embedding/head weight alone (so the first and the last stage hold it in flat
    buffers of the same layout and reduce it with the same arithmetic: the copies stay bitwise
    equal), the other non-block parameters (e.g. position embeddings and final norm), then each
    block; inside a unit one flat buffer per (weight decay, tp-sharded) pair.

      stage 1  gradients accumulate in full locally (``param.grad`` are views into each flat's
               ``grad_full``) over every micro-batch and flush; :meth:`finish_grads` reduce-scatters
               every flat buffer over dp.
      stage 2  after every backward action of the schedule (one micro-batch through one local
               chunk) the runner calls :meth:`after_backward`: the buffers that received gradients
               are reduce-scattered and accumulated into the fp32 shards, and the full gradients
               freed. Reduce-scattering each micro-batch's (or chunk's) part and summing the shards
               is the sum ZeRO-2 computes over micro-batches on one pipeline-free rank.
      stage 3  parameters sharded at rest as well: blocks are gathered around their forward and
               backward (``data.zero_gather.UnitGatherer``, prefetching), the root units for the
               whole step (:meth:`begin_step` .. :meth:`end_step`) or a ``full_params`` context.

    Then :meth:`finish_grads` sums the tied shard over ``tied_group`` (and, with sequence
    parallelism, the tp-replicated shards over tp), every sum in ``reduce_dtype``; AdamW steps the
    fp32 master shards; :meth:`gather_params` all-gathers the updated parameters (stages 1-2).

    Args: ``module`` (a StageModel), ``group`` (dp NamedGroup), ``mask`` (decay flag by
    ``id(param)``), ``tied`` (this rank's tied Parameter or None), ``stage`` (1, 2, 3),
    ``dtype``/``reduce_dtype`` (see ``parallel.precision``). Attributes: ``all_flats`` (list of
    FlatShard; each has ``tp_sharded`` and ``is_tied``), ``group``, ``stage``. Raises ValueError for
    a stage outside 1-3."""

    def __init__(self, module, group, mask: dict, tied=None, dtype: str = "fp32", reduce_dtype: str = "auto",
                 stage: int = 1):
        if stage not in (1, 2, 3):
            raise ValueError(f"pipeline ZeRO stage must be 1, 2 or 3, got {stage}")
        compute, reduce = precision.compute_dtype(dtype), precision.reduce_dtype(dtype, reduce_dtype)
        self.group, self.tied, self.stage = group, tied, stage
        names = {}
        for n, q in module.named_parameters():  # first FQN of each (tied) parameter
            names.setdefault(id(q), n)
        blocks = list(module.blocks_here.values())
        in_block = {id(q) for b in blocks for q in b.parameters()}
        root = [q for q in unique_params(module) if id(q) not in in_block and q is not tied]
        roots = ([[tied]] if tied is not None else []) + [root]
        units = roots + [unique_params(b) for b in blocks]
        self.flats = build_flats(units, names, mask, stage, group, compute, reduce, tied)
        self.all_flats = [f for fl in self.flats for f in fl]
        self.gatherer = UnitGatherer(self.flats, n_root=len(roots))
        if stage == 3:
            self.gatherer.register(blocks)

    def no_sync(self):
        """Nothing is communicated during backward: every micro-batch only accumulates."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for f in self.all_flats:
            f.zero_grad()

    def begin_step(self) -> None:
        """Stage 3: gather the root units for the step (used at both ends of the stages)."""
        if self.stage == 3:
            self.gatherer.gather_roots()

    def end_step(self) -> None:
        """Stage 3: nothing gathered (or still gathering) survives the step."""
        if self.stage == 3:
            self.gatherer.release_all()

    def after_backward(self) -> None:
        """Stages 2-3, after one backward action: reduce-scatter every flat buffer that received
        gradients (in ``reduce_dtype``), accumulate into the shards, free the full gradients; stage 3
        also frees the blocks' gathered parameters. Stage 1: nothing (gradients accumulate)."""
        if self.stage == 1:
            return
        launched = [f for f in self.all_flats if any(q.grad is not None for q in f.params)]
        for f in launched:
            f.launch_reduce()
        for f in launched:
            f.wait_reduce()
        if self.stage == 3:
            for u in range(self.gatherer.n_root, len(self.flats)):
                self.gatherer.free(u)

    def gather_blocks(self) -> None:
        """Stage 3: all-gather every block unit (a W of a split backward reads the weights: saved
        tensors, recomputation); :meth:`after_backward` frees them again. Stages 1-2: nothing."""
        if self.stage == 3:
            for u in range(self.gatherer.n_root, len(self.flats)):
                self.gatherer.gather(u)

    @contextlib.contextmanager
    def full_params(self, blocks: bool = True):
        """Stage 3: the root units (and every block when ``blocks``; otherwise the blocks' forward
        hooks gather them one at a time) gathered for the context (evaluation, generation, export,
        state dicts); freed on exit. Stages 1-2: nothing to do (parameters are full at rest)."""
        if self.stage == 3:
            for u in range(len(self.flats) if blocks else self.gatherer.n_root):
                self.gatherer.gather(u)
            self.gatherer.hold += blocks  # everything gathered: forwards (e.g. generate) keep it
        try:
            yield
        finally:
            if self.stage == 3:
                self.gatherer.hold -= blocks
                self.gatherer.release_all()

    def finish_grads(self, tied_group=None, tp_group=None) -> None:
        """Stage 1: reduce-scatter every flat gradient over dp (in ``reduce_dtype``; stages 2-3 did
        it in :meth:`after_backward`), then sum the tied
        shard over ``tied_group`` (first and last pipeline rank of this (dp, tp) coordinate: same
        flat layout, same dp shard; the sums commute) and, when ``tp_group`` is given (sequence
        parallel), the tp-replicated shards over tp (same layout on every tp rank). Both sums run
        on the fp32 shard gradients in ``reduce_dtype`` (``comm.all_reduce_in``) -- summing the
        compute-dtype (bf16) ``grad_full`` instead would ignore an fp32 reduce dtype. Exposes the
        fp32 shard gradients as ``master.grad``."""
        if self.stage == 1:
            for f in self.all_flats:
                f.launch_reduce()
            for f in self.all_flats:
                f.wait_reduce()
        else:
            self.after_backward()  # gradients of a backward not followed by after_backward (none normally)
        if tied_group is not None:
            for f in self.all_flats:
                if f.is_tied:
                    comm.all_reduce_in(f.shard_grad, f.reduce_dtype, group=tied_group, tag="pp_tied")
        if tp_group is not None:
            for f in self.all_flats:
                if not f.tp_sharded:
                    comm.all_reduce_in(f.shard_grad, f.reduce_dtype, group=tp_group, tag="tp_grad")
        for f in self.all_flats:
            f.master.grad = f.shard_grad

    def gather_params(self) -> None:
        """All-gather the updated master shards into the full compute parameters (after step; stage
        3: only inside :meth:`full_params` or a step, so here nothing)."""
        if self.stage == 3:
            return
        with torch.no_grad():
            for f in self.all_flats:
                f.launch_gather()
            for f in self.all_flats:
                f.wait_gather()
