"""Expert parallelism under the native pipeline executor (``parallel.pipeline.runner``): each
stage's experts divided over the ep ranks of its batch group (dp x cp), the all-to-all inside the stage's forward
and backward (B of a split backward: the expert weight gradients of W are local matmuls).

The ep groups are carved out of every batch group of the world (one per (pp, tp) coordinate,
:func:`~zerotron.parallel.expert.strategy.expert_groups`), so the ranks of one ep group hold the
same pipeline stage and walk the same action list: their all-to-alls (forward, B, W of model stage
0, recomputation) meet in the same order. The dense model is sharded before the split
(:class:`StageExperts`), every block's experts (the other stages' storage is freed as usual and
broadcast back over pp by ``full_params`` at its shard size). Gradients: the stage's non-expert
parameters as the runner syncs them (DDP buckets or ZeRO's flat buffers over dp), the expert ones
summed over the replica group (DDP: one flat buffer, :meth:`StageExperts.reduce_grads`; ZeRO:
their flat buffers sharded over it, ``ZeroSync``'s ``group_of``). Canonical state: expert tensors
gathered over ep (:meth:`StageExperts.gather_entries`), sliced again on load."""
from __future__ import annotations

from zerotron.parallel.expert.strategy import _ExpertShards

__all__ = ["StageExperts"]


class StageExperts(_ExpertShards):
    """The expert shards of one pipeline rank. Args: ``model`` the dense (or tensor-parallel)
    model before the pipeline split, identical on every rank (sharded here, in place: each MoE
    layer keeps experts ``ep_rank*E/ep .. (ep_rank+1)*E/ep - 1`` and gets the all-to-all
    dispatch); ``dp_group`` this rank's batch group (dp x cp); ``ep`` (divides it and E); ``lines`` the global
    ranks of every batch group (``Dims.group_ranks("batch")``). Collective over the world (group creation).

    Attributes: ``ep_group``, ``rep_group``, ``ep_rank``, ``ep``; ``every`` {FQN: local shard} of
    every block; after :meth:`keep`, ``expert_params`` those of this rank's stages."""

    def __init__(self, model, dp_group, ep: int, lines):
        self._shard(model, dp_group, ep, lines)
        self.every = dict(self.expert_params)

    def keep(self, stage_module) -> frozenset:
        """Restrict ``expert_params`` to the parameters of ``stage_module``; returns their ids."""
        own = {id(q) for q in stage_module.parameters()}
        self.expert_params = {n: q for n, q in self.every.items() if id(q) in own}
        self._expert_ids = frozenset(id(q) for q in self.expert_params.values())
        return self._expert_ids

    @property
    def ids(self) -> frozenset:
        return self._expert_ids

    def decay_flags(self, mask: dict, before: dict) -> dict:
        """``mask`` (decay flag by ``id(param)`` of the unsharded model, ``before``: its
        {FQN: Parameter}) extended to the expert shards (new Parameters)."""
        return {**mask, **{id(q): mask.get(id(before[n]), q.dim() >= 2) for n, q in self.every.items()}}

    # ---- native DDP: one flat gradient buffer for the stage's experts, summed over the replicas
    def attach_grads(self) -> None:
        self._grad_buffer()

    def zero_grads(self) -> None:
        self._zero_expert_grads()

    def reduce_grads(self) -> None:
        """Sum the expert gradients over the replica group (after the last backward of the step)."""
        self._reduce_expert_grads()

    # ---- canonical state ---------------------------------------------------------------------
    def gather_entries(self, msd: dict, osd: dict | None):
        """This stage's expert entries of a canonical state (this ep rank's range) gathered over ep
        to the full (E, ...) tensors. Collective over ep (the same names on every ep rank)."""
        return self._full_expert_state(msd, osd)

    def slice_entries(self, msd: dict, osd: dict | None):
        """A canonical state with this stage's expert tensors cut to this ep rank's range."""
        return self._local_expert_state(msd, osd)

    def full_model(self, dense):
        """``dense`` (every block's expert shards present, e.g. inside the pipeline's ``full_params``)
        with every expert of every layer gathered over ep and the local dispatch; restored on exit.
        Collective over ep."""
        return self._full_experts(dense, self.every)
