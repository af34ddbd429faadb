"""Expert parallelism under torch FSDP2 (``parallel.zero_impl = "fsdp2"``, ZeRO-2/3 semantics):
:class:`ExpertFSDP2`.

The experts of each MoE layer are first cut to this rank's E/ep range (``dispatch.shard_experts``,
the all-to-all dispatch installed over the ep group), then each block's experts module is
``fully_shard``-ed over the expert-replica group (the dp/ep ranks holding the same experts, a
DeviceMesh of its own) before the blocks and the root are sharded over dp as without experts: the
blocks' FSDP units leave the experts' parameters to the nested unit. The layout is torchtitan's
(a separate mesh dimension for the experts' data parallelism, dp/ep, beside the dense one, dp); the
code is zerotron's.

Gradient scale. FSDP2 averages each unit's gradients over its own group (gloo has no PREMUL_SUM
for a custom divide factor, and ``set_gradient_divide_factor`` with a sum reduction divides twice
on a one-rank group in torch 2.13), and zerotron divides the token loss by N_global / B
(``parallel.data.fsdp``; B = dp x cp, the batch group), so a gradient computed on one rank is B
times its share of the normalised sum. The dense units average over B: (1/B) sum_B B g = sum g. An
expert's gradient on a rank already holds the sum over its ep group's tokens (the dispatch
backward) and is then averaged over B/ep replicas: (ep/B) sum_{B/ep} B g = ep sum g; :meth:`ExpertFSDP2.finish_grads`
divides the expert gradient shards by ep (exact for a power-of-two ep), after FSDP2's reduce-scatter
has completed (backward has returned). The MoE auxiliary losses reach only the router (dense), whose
scale ``FSDP2Strategy`` already sets to dp.

Gradient norm: expert and dense shards are disjoint over the whole dp group (E/ep experts per ep
coordinate, 1/(dp/ep) of them per replica), so FSDP2's one rule (squares summed over the shard
group) counts each element once. The canonical state gathers FSDP2's full state dict (over the
replica group) and then the expert tensors over ep; checkpoints hand DCP that full state (each key
written once). ``full_params`` builds a dense plain copy of the model from the canonical state
(every expert, the local dispatch): evaluation, generation and export on one rank.

Refused by the plan: FSDP2's HSDP (``parallel.dp_replicate > 1``) with ep > 1 (the experts would
need a 2-D replicate x shard mesh of their own).
"""
from __future__ import annotations

import contextlib

import torch

from zerotron.models.layout import get_module, retie
from zerotron.parallel.data.fsdp import FSDP2Strategy
from zerotron.parallel.data.fsdp_comm import count_fsdp_collectives
from zerotron.parallel.expert.strategy import _ExpertShards

__all__ = ["ExpertFSDP2"]


class ExpertFSDP2(_ExpertShards, FSDP2Strategy):
    """FSDP2 over dp for the non-expert parameters, each MoE layer's experts cut to this rank's E/ep
    range and ``fully_shard``-ed over the expert-replica group (module docstring).

    Args: ``model`` (dense, identically initialised on every rank; tensor-parallel without SP when
    ``parallel.tp > 1``, the experts tp-replicated), ``mesh`` (zerotron Mesh, no HSDP replication;
    the ep groups carved out of its batch group dp x cp), ``ep`` (divides dp x cp and n_experts), ``stage`` (2 or 3), ``dtype``,
    ``reduce_dtype`` as :class:`~zerotron.parallel.data.fsdp.FSDP2Strategy`. Raises ValueError for
    a model without experts or ``mesh`` with HSDP replication."""

    def __init__(self, model, mesh, ep: int, stage: int, dtype: str = "fp32", reduce_dtype: str = "auto"):
        from torch.distributed.device_mesh import DeviceMesh

        if mesh.hsdp_mesh is not None:
            raise ValueError("expert parallelism under FSDP2 runs without HSDP replication (parallel.dp_replicate 1)")
        self._experts_path = model.layout().experts.experts if model.layout().experts is not None else None
        self._shard(model, mesh.group("batch"), ep, mesh.dims.group_ranks("batch"))
        self._rep_mesh = DeviceMesh.from_group(self.rep_group.pg, mesh.device.type)
        names = list(self.expert_params)
        FSDP2Strategy.__init__(self, model, mesh, stage, dtype, reduce_dtype)
        params = dict(model.named_parameters())  # fully_shard made new (DTensor) Parameters
        self.expert_params = {n: params[n] for n in names}
        self._expert_ids = frozenset(id(p) for p in self.expert_params.values())
        self._mark_ep_shards()

    def _shard_inner(self, blocks: list, reshard: bool, mp) -> list:
        """Every block's experts module sharded over the expert-replica group (before its block)."""
        from torch.distributed.fsdp import fully_shard

        mods = [get_module(b, self._experts_path) for b in blocks]
        for m in mods:
            fully_shard(m, mesh=self._rep_mesh, reshard_after_forward=reshard, mp_policy=mp)
        count_fsdp_collectives(mods, self.rep_group)
        return mods

    def _mark_ep_shards(self) -> None:
        for p in self.expert_params.values():
            p.ep_shard = (self.ep_rank, self.ep)

    def finish_grads(self) -> None:
        """FSDP2's work (the sequence-parallel tp sums), then the expert gradient shards divided by
        ep: FSDP2 averaged them over dp/ep ranks where the loss scale assumed dp (module docstring)."""
        FSDP2Strategy.finish_grads(self)
        with torch.no_grad():
            for p in self.expert_params.values():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    g.div_(self.ep)

    def state_dict(self, optimizer=None):
        """FSDP2's full state (gathered over dp and over the replica group), expert tensors then
        gathered over ep: the canonical dense state. Collective over dp."""
        return self._full_expert_state(*FSDP2Strategy.state_dict(self, optimizer))

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """A canonical state (any layout): this rank's expert range, then FSDP2 keeps its shards."""
        FSDP2Strategy.load_state_dict(self, *self._local_expert_state(msd, osd), optimizer)
        self._mark_ep_shards()

    def checkpoint_state(self, optimizer=None):
        """The canonical full state on every rank (DCP writes each key once): FSDP2's sharded
        DTensors would describe E/ep experts under the names of all E."""
        return self.state_dict(optimizer)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load what :meth:`checkpoint_state` described (the full state)."""
        self.load_state_dict(msd, osd, optimizer)

    @contextlib.contextmanager
    def full_params(self):
        """A dense plain copy of the model holding every parameter (all E experts, the local
        dispatch), built from the canonical state: evaluation, generation and export need no
        collective inside. Collective on entry (the state gather). Yields the copy; changes to it
        do not reach the training parameters."""
        msd, _ = self.state_dict()
        src = self.module
        with torch.device("meta"):  # no RNG draw, no init cost
            dense = type(src)(src.config)
        w = next(iter(msd.values()))
        dense = dense.to_empty(device=w.device).to(w.dtype)
        retie(dense, dense.layout())  # to_empty makes new Parameters
        dense.init_buffers()  # non-persistent buffers (e.g. RoPE tables) are not in msd
        with torch.no_grad():
            dense.load_state_dict(msd)
        dense.train(src.training)
        yield dense
