"""Expert parallelism composed with a data-parallel synchroniser: :class:`ExpertDataParallel`
(native DDP, flat or hierarchical under HSDP), :class:`ExpertTorchDDP` (torch DDP over the
non-expert parameters) and :class:`ExpertZero` (native ZeRO-1/2/3, HSDP included, one driver with a
shard group per parameter set); FSDP2 in :mod:`.fsdp`.

Groups (carved out of the batch group dp x cp, as torchtitan and Megatron-Core do: under context
parallelism each cp rank holds a different chunk of the same sequences, so the tokens routed to the
experts come from every dp x cp rank): batch rank d (``coords["batch"]``, cp innermost) has ep
coordinate ``d % ep``; the ep group of d is ``{d - d % ep, ..., d - d % ep + ep - 1}`` (consecutive
batch ranks: the cp peers first, the all-to-all stays among neighbours), its expert-replica group
``{d' : d' % ep == d % ep}`` (the dp x cp / ep ranks holding the same experts). Without cp the batch
group is the dp group. Non-expert parameters are data parallel over all of dp x cp (DDP buckets, or ZeRO's
flat buffers sharded over dp_shard x cp); expert parameters are sharded over ep (their optimizer state with
them: 1/ep per rank) and data parallel over the replica group (DDP: their gradients all-reduced
over it; ZeRO: flat buffers of their own sharded over it, so 1/dp per rank) -- after the dispatch
backward they already hold the sum over their ep group's tokens, so the result is the sum over
every batch rank's tokens, with the loss normalised by the global target count as everywhere
(``parallel.base``). Gradient norm: expert shards' squares summed over ep (DDP) or, with ZeRO,
every shard's over dp (disjoint there), each element once. The canonical state (checkpoints,
parity) holds full expert tensors, gathered over ep.

HSDP (``parallel.dp_replicate`` R > 1, dp = R x S): ep must divide S x cp, so every ep group (ep
consecutive batch ranks) lies inside one shard group, normally one node. Native DDP keeps its
hierarchical all-reduce for the non-expert buckets and all-reduces the expert buffer over the
replica group (all dp ranks with this ep coordinate). ZeRO shards the non-expert flat buffers over
the shard group and the expert ones over the S/ep ranks of this shard group with this ep
coordinate (``expert_groups`` over the shard groups' lines); HSDP's once-per-step all-reduce
across the R replicas then completes both sums.

The groups are built here from the mesh's batch (or shard) lines (``Dims.group_ranks``); they could
become named groups of ``distributed.mesh``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.parallel.data.ddp import DataParallel, TorchDDP
from zerotron.parallel.data.zero import ZeroStrategy
from zerotron.parallel.expert.dispatch import local_dispatch, shard_experts
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.tensor.layers import is_tp_sharded

__all__ = ["ExpertDataParallel", "ExpertTorchDDP", "ExpertZero", "expert_groups"]


def expert_groups(dp_group, ep: int, lines: list | None = None):
    """``(ep_group, replica_group, ep_rank)`` of this rank, as ``comm.NamedGroup``s ("ep",
    "ep_rep"), carved out of each batch group: ``lines`` lists the global ranks of every batch group
    of the world (``Dims.group_ranks("batch")``: one per (pp, tp) coordinate, dp x cp ranks each;
    under HSDP the "shard" lines), default the ranks of ``dp_group`` alone (a world that is one dp group). Every rank creates every group, in the
    same order, as ``dist.new_group`` requires."""
    me = dist.get_rank()
    lines = lines or [dist.get_process_group_ranks(dp_group.pg)]
    mine = {}
    for ranks in lines:
        dp = len(ranks)
        for start in range(0, dp, ep):
            members = [ranks[i] for i in range(start, start + ep)]
            g = comm.new_group(members)
            if me in members:
                mine["ep"], mine["rank"] = comm.NamedGroup(g, "ep"), members.index(me)
        for c in range(ep):
            members = [ranks[i] for i in range(c, dp, ep)]
            g = comm.new_group(members)
            if me in members:
                mine["ep_rep"] = comm.NamedGroup(g, "ep_rep")
    return mine["ep"], mine["ep_rep"], mine["rank"]


class _ExpertShards:
    """What both synchronisers add for the expert-local parameters (``self.expert_params``, name ->
    local Parameter): one flat gradient buffer (grads are views), its sum over the replica group,
    gathering/slicing over ep, and :meth:`full_params`."""

    def _shard(self, model, dp_group, ep: int, lines=None) -> frozenset:
        """Build the groups (:func:`expert_groups`), keep this rank's experts; returns their ids."""
        self.ep_group, self.rep_group, self.ep_rank = expert_groups(dp_group, ep, lines)
        self.ep = ep
        self.expert_params = shard_experts(model, model.layout(), self.ep_rank, ep, self.ep_group)
        self._expert_ids = frozenset(id(p) for p in self.expert_params.values())
        return self._expert_ids

    def _grad_buffer(self) -> None:
        """DDP: one flat gradient buffer for the expert parameters (their grads are views)."""
        plist = list(self.expert_params.values())
        self._ebuf = torch.zeros(sum(p.numel() for p in plist), dtype=plist[0].dtype, device=plist[0].device)
        self._attach()

    def _attach(self) -> None:
        off = 0
        for p in self.expert_params.values():
            p.grad = self._ebuf[off:off + p.numel()].view_as(p)
            off += p.numel()

    def _zero_expert_grads(self) -> None:
        self._ebuf.zero_()
        self._attach()

    def _reduce_expert_grads(self) -> None:
        if self.rep_group.size() > 1:
            comm.all_reduce(self._ebuf, group=self.rep_group, tag="grad")

    def _expert_grads(self) -> list:
        return [p.grad for p in self.expert_params.values()]

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's expert slice (E/ep, ...) -> the full (E, ...) tensor. Collective over ep."""
        t = t.detach().contiguous()
        out = t.new_empty((self.ep * t.size(0),) + tuple(t.shape[1:]))
        comm.all_gather(out.view(-1), t.view(-1), group=self.ep_group, tag="state")
        return out

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        n = t.size(0) // self.ep
        return t[self.ep_rank * n:(self.ep_rank + 1) * n].clone()

    def _full_expert_state(self, msd, osd):
        """Expert entries of a canonical state (this ep rank's range) gathered over ep."""
        for name in self.expert_params:
            if name in msd:
                msd[name] = self._gather(msd[name])
            if osd is not None and name in osd["state"]:
                osd["state"][name] = {k: self._gather(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                      for k, v in osd["state"][name].items()}
        return msd, osd

    def _local_expert_state(self, msd, osd):
        """A canonical state (any layout) with this rank's expert range cut from the expert entries."""
        msd = {k: self._slice(v) if k in self.expert_params else v for k, v in msd.items()}
        if osd is not None:
            osd = {**osd, "state": {k: ({n: self._slice(x) if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                                         for n, x in st.items()} if k in self.expert_params else st)
                                    for k, st in osd["state"].items()}}
        return msd, osd

    def _with_full_experts(self, msd, osd, optimizer):
        """Add the gathered expert parameters (and Adam moments) to a canonical state."""
        for name, p in self.expert_params.items():
            msd[name] = self._gather(p.data)
            if osd is not None and optimizer is not None and p in optimizer.state:
                osd["state"][name] = {k: self._gather(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                      for k, v in optimizer.state[p].items()}
        return msd, osd

    @contextlib.contextmanager
    def _full_experts(self, module, params: dict | None = None):
        """``module`` with every expert on this rank and the local dispatch; ``params`` ({name:
        expert shard Parameter}, default ``expert_params``; a pipeline rank passes every stage's)
        gathered over ep on entry (collective), restored on exit."""
        from zerotron.models.layout import get_module

        params = self.expert_params if params is None else params
        layout = module.layout()
        local = {n: p.data for n, p in params.items()}
        moes = [get_module(b, layout.experts.moe) for b in get_module(module, layout.blocks)]
        hooks = [m.dispatch for m in moes]
        full = {n: self._gather(p.data) for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data = full[n]
            for m in moes:
                m.dispatch = local_dispatch
            yield module
        finally:
            for n, p in params.items():
                p.data = local[n]
            for m, hook in zip(moes, hooks):
                m.dispatch = hook


class _ReplicatedExperts(_ExpertShards):
    """What a DDP synchroniser (native or torch's) adds under expert parallelism: the expert
    gradients in a flat buffer of their own, summed over the replica group after the synchroniser's
    reduction; the norm, the canonical state (experts gathered over ep) and ``full_params``. Mixed
    in before the synchroniser's class (cooperative ``super()``)."""

    def zero_grad(self) -> None:
        super().zero_grad()
        self._zero_expert_grads()

    def finish_grads(self) -> None:
        """The synchroniser's reductions over dp, then the expert gradients summed over the replica group."""
        super().finish_grads()
        self._reduce_expert_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Expert shards' squares summed over ep; the rest as DDP counts them (tp shards over tp)."""
        dense = [(p.grad, p) for p in self.parameters() if p.grad is not None and id(p) not in self._expert_ids]
        return clip_grad_norm([([g for g, p in dense if is_tp_sharded(p)], [self.tp_group]),
                               ([g for g, p in dense if not is_tp_sharded(p)], []),
                               (self._expert_grads(), [self.ep_group])], max_norm)

    def state_dict(self, optimizer=None):
        """Canonical state: expert parameters and their Adam moments gathered over ep."""
        msd, osd = super().state_dict(optimizer)
        return self._with_full_experts(msd, osd, optimizer)

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical state, keeping this rank's expert range."""
        super().load_state_dict(*self._local_expert_state(msd, osd), optimizer)

    def full_params(self):
        return self._full_experts(self.module)


class ExpertDataParallel(_ReplicatedExperts, DataParallel):
    """Native DDP over ``dp_group`` for the non-expert parameters, expert parameters sharded over
    ``ep`` (module docstring). Args: ``model`` (dense, identically initialised on every rank: it is
    sharded here), ``dp_group``, ``ep``, ``bucket_mb``, ``src_rank`` as DataParallel; ``lines`` as
    :func:`expert_groups`; ``shard_group``/``replicate_group`` (HSDP, ``data.hsdp.ddp_hierarchy``):
    the non-expert buckets' hierarchical all-reduce."""

    def __init__(self, model, dp_group, ep: int, bucket_mb: float = 25.0, src_rank: int = 0, lines=None,
                 shard_group=None, replicate_group=None):
        ids = self._shard(model, dp_group, ep, lines)
        self._grad_buffer()
        DataParallel.__init__(self, model, dp_group, bucket_mb=bucket_mb, src_rank=src_rank, exclude=ids,
                              shard_group=shard_group, replicate_group=replicate_group)


class ExpertTorchDDP(_ReplicatedExperts, TorchDDP):
    """torch's DDP over ``dp_group`` for the non-expert parameters (the expert ones are in its
    ignore list: torch DDP takes one process group, and would also broadcast rank 0's experts at
    construction), expert parameters sharded over ``ep`` and all-reduced over the replica group in
    :meth:`finish_grads` (after torch DDP's backward has reduced the rest). Args as
    :class:`~zerotron.parallel.data.ddp.TorchDDP` plus ``ep`` and ``lines`` (:func:`expert_groups`)."""

    def __init__(self, model, dp_group, ep: int, bucket_mb: float = 25.0, find_unused_parameters: bool = False,
                 lines=None):
        self._shard(model, dp_group, ep, lines)
        self._grad_buffer()
        TorchDDP.__init__(self, model, dp_group, bucket_mb=bucket_mb, find_unused_parameters=find_unused_parameters,
                          ignore=list(self.expert_params))


class ExpertZero(_ExpertShards, ZeroStrategy):
    """Native ZeRO stage 1, 2 or 3 with experts sharded over ``ep``: one ZeRO driver
    (:class:`~zerotron.parallel.data.zero.ZeroSync`) over every parameter, the non-expert ones in
    flat buffers sharded over ``dp_group``, the expert ones (this rank's E/ep experts) in flat
    buffers of their own sharded over the expert-replica group (dp/ep ranks holding the same
    experts; ``group_of``). Their gradients already hold the sum over the ep group's tokens (the
    dispatch backward), so the reduce-scatter over the replica group completes the sum over dp; the
    optimizer state (and at stage 2 the gradients, at stage 3 the parameters) of an expert is
    1/dp of it per rank (1/ep from ep, 1/(dp/ep) from ZeRO). The gradient norm sums the squares of
    every shard over dp, in which expert and non-expert shards are both disjoint.

    Args as :class:`ZeroStrategy` (``stage`` 1, 2 or 3, ``offload``, ``offload_dir``, ``tp_group``: tensor
    parallelism, the experts tp-replicated; ``sequence_parallel``: their shard gradients, and every
    tp-replicated one, summed over tp; ``replicate_group`` and ``full_dp_group`` (the whole dp group) for
    HSDP, ``dp_group`` then the shard group: ep carved out of it, ``lines`` its groups' ranks) plus ``ep``
    and ``lines`` (:func:`expert_groups`). The canonical state (and a
    checkpoint: every rank hands over the full state, DCP writes each key once) holds the full
    expert tensors, gathered over the replica group and then over ep."""

    def __init__(self, model, dp_group, ep: int, stage: int = 1, dtype: str = "fp32", reduce_dtype: str = "auto",
                 mask=None, offload: str = "none", tp_group=None, lines=None, offload_dir: str = "",
                 sequence_parallel: bool = False, replicate_group=None, full_dp_group=None):
        before = dict(model.named_parameters())
        self._shard(model, dp_group, ep, lines)
        if mask is not None:  # the expert shards are new Parameters: the dense ones' decay flags
            mask = {**mask, **{id(q): mask.get(id(before[n]), q.dim() >= 2) for n, q in self.expert_params.items()}}
        group_of = {id(p): self.rep_group for p in self.expert_params.values()}
        ZeroStrategy.__init__(self, model, dp_group, stage, dtype, reduce_dtype, mask, tp_group=tp_group,
                              sequence_parallel=sequence_parallel, offload=offload, group_of=group_of,
                              offload_dir=offload_dir, replicate_group=replicate_group, dp_group=full_dp_group)

    def expert_state_bytes(self, optimizer) -> dict:
        """Bytes held now by the expert flat buffers (this rank's E/ep experts, sharded over the
        replica group): :func:`~zerotron.parallel.data.flat_units.flat_state_bytes` of those
        buffers (``params_bytes``, ``grads_bytes``, ``optimizer_bytes``, ``total_bytes``)."""
        from zerotron.parallel.data.flat_units import flat_state_bytes

        return flat_state_bytes([f for f in self.all_flats if any(id(p) in self._expert_ids for p in f.params)],
                                optimizer)

    def state_dict(self, optimizer=None):
        """ZeRO's canonical state, expert tensors gathered over ep. Collective over dp."""
        return self._full_expert_state(*ZeroStrategy.state_dict(self, optimizer))

    checkpoint_snapshot = None  # an async save stages checkpoint_state (it gathers over ep too) in the foreground

    def checkpoint_state(self, optimizer=None):
        """The whole canonical state on every rank (the expert buffers' owners would hold only their
        ep range): DCP writes each key once, so the files equal any layout's."""
        return self.state_dict(optimizer)

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """A canonical state (any layout): this rank's expert range, then ZeRO keeps its shards."""
        ZeroStrategy.load_state_dict(self, *self._local_expert_state(msd, osd), optimizer)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load what :meth:`checkpoint_state` described (the full state)."""
        self.load_state_dict(msd, osd, optimizer)

    @contextlib.contextmanager
    def full_params(self, blocks: bool = True):
        """ZeRO's full parameters; with ``blocks`` also every expert on this rank (gathered over ep,
        the local dispatch: evaluation, generation, export). ``blocks=False`` is ZeRO-3's per-step
        root gather (the experts stay sharded, the all-to-all dispatch in place)."""
        with ZeroStrategy.full_params(self, blocks) as module:
            if not blocks:
                yield module
                return
            with self._full_experts(module) as m:
                yield m
