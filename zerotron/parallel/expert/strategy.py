"""Expert parallelism composed with a data-parallel synchroniser: :class:`ExpertDataParallel`
(native DDP) and :class:`ExpertZero1` (native ZeRO-1).

Groups (carved out of the dp group, as torchtitan does): dp rank d has ep coordinate ``d % ep``;
the ep group of d is ``{d - d % ep, ..., d - d % ep + ep - 1}`` (consecutive dp ranks: the all-to-all
stays among neighbours), its expert-replica group ``{d' : d' % ep == d % ep}`` (dp/ep ranks holding
the same experts). Non-expert parameters are data parallel over all of dp (DDP buckets, or ZeRO-1's
flat buffers with optimizer state sharded over dp); expert parameters are sharded over ep (their
optimizer state with them: 1/ep per rank) and their gradients summed over the replica group --
after the dispatch backward they already hold the sum over their ep group's tokens, so the result
is the sum over every dp rank's tokens, with the loss normalised by the global target count as
everywhere (``parallel.base``). Gradient norm: expert shards' squares summed over ep (disjoint),
the rest as the synchroniser counts them. The canonical state (checkpoints, parity) holds full
expert tensors, gathered over ep.

The groups live here while ep composes with data parallelism alone (the plan refuses pp, tp, cp,
HSDP with ep); they belong in ``distributed.mesh`` once it does.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.parallel.data.ddp import DataParallel
from zerotron.parallel.data.zero import ZeroStrategy
from zerotron.parallel.expert.dispatch import local_dispatch, shard_experts
from zerotron.parallel.grad_norm import clip_grad_norm

__all__ = ["ExpertDataParallel", "ExpertZero1", "expert_groups"]


def expert_groups(dp_group, ep: int):
    """``(ep_group, replica_group, ep_rank)`` of this rank, as ``comm.NamedGroup``s ("ep",
    "ep_rep"), built from the ranks of ``dp_group`` (every rank of the world creates every group, in
    the same order, so the world must be made of dp groups of the same layout: the plan ensures it)."""
    ranks = dist.get_process_group_ranks(dp_group.pg)
    dp, d = len(ranks), ranks.index(dist.get_rank())
    mine = {}
    for start in range(0, dp, ep):
        g = dist.new_group([ranks[i] for i in range(start, start + ep)])
        if start <= d < start + ep:
            mine["ep"] = comm.NamedGroup(g, "ep")
    for c in range(ep):
        g = dist.new_group([ranks[i] for i in range(c, dp, ep)])
        if d % ep == c:
            mine["ep_rep"] = comm.NamedGroup(g, "ep_rep")
    return mine["ep"], mine["ep_rep"], d % ep


class _ExpertShards:
    """What both synchronisers add for the expert-local parameters (``self.expert_params``, name ->
    local Parameter): one flat gradient buffer (grads are views), its sum over the replica group,
    gathering/slicing over ep, and :meth:`full_params`."""

    def _shard(self, model, dp_group, ep: int) -> frozenset:
        self.ep_group, self.rep_group, self.ep_rank = expert_groups(dp_group, ep)
        self.ep = ep
        self.expert_params = shard_experts(model, model.layout(), self.ep_rank, ep, self.ep_group)
        self._expert_ids = frozenset(id(p) for p in self.expert_params.values())
        plist = list(self.expert_params.values())
        self._ebuf = torch.zeros(sum(p.numel() for p in plist), dtype=plist[0].dtype, device=plist[0].device)
        self._attach()
        return self._expert_ids

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

    def _with_full_experts(self, msd, osd, optimizer):
        """Add the gathered expert parameters (and Adam moments) to a canonical state."""
        for name, p in self.expert_params.items():
            msd[name] = self._gather(p.data)
            if osd is not None and optimizer is not None and p in optimizer.state:
                osd["state"][name] = {k: self._gather(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                      for k, v in optimizer.state[p].items()}
        return msd, osd

    @torch.no_grad()
    def _load_experts(self, msd, osd, optimizer) -> None:
        for name, p in self.expert_params.items():
            if name in msd:
                p.data.copy_(self._slice(msd[name]))
            if osd is not None and optimizer is not None and name in osd.get("state", {}):
                optimizer.state[p] = {k: self._slice(v).to(p.dtype) if isinstance(v, torch.Tensor) and v.dim() > 0
                                      else (v.clone() if isinstance(v, torch.Tensor) else v)
                                      for k, v in osd["state"][name].items()}

    def _expert_bytes(self, optimizer) -> dict:
        plist = list(self.expert_params.values())
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        o = sum(nb(t) for p in plist for t in optimizer.state.get(p, {}).values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"params_bytes": sum(nb(p) for p in plist), "grads_bytes": nb(self._ebuf), "optimizer_bytes": o}

    @contextlib.contextmanager
    def _full_experts(self, module):
        """``module`` with every expert on this rank and the local dispatch; gathered over ep on
        entry (collective), restored on exit."""
        from zerotron.models.layout import get_module

        layout = module.layout()
        local = {n: p.data for n, p in self.expert_params.items()}
        moes = [get_module(b, layout.experts.moe) for b in get_module(module, layout.blocks)]
        hooks = [m.dispatch for m in moes]
        full = {n: self._gather(p.data) for n, p in self.expert_params.items()}
        try:
            for n, p in self.expert_params.items():
                p.data = full[n]
            for m in moes:
                m.dispatch = local_dispatch
            yield module
        finally:
            for n, p in self.expert_params.items():
                p.data = local[n]
            for m, hook in zip(moes, hooks):
                m.dispatch = hook


class ExpertDataParallel(_ExpertShards, DataParallel):
    """Native DDP over ``dp_group`` for the non-expert parameters, expert parameters sharded over
    ``ep`` (module docstring). Args: ``model`` (dense, identically initialised on every rank: it is
    sharded here), ``dp_group``, ``ep``, ``bucket_mb``, ``src_rank`` as DataParallel."""

    def __init__(self, model, dp_group, ep: int, bucket_mb: float = 25.0, src_rank: int = 0):
        ids = self._shard(model, dp_group, ep)
        DataParallel.__init__(self, model, dp_group, bucket_mb=bucket_mb, src_rank=src_rank, exclude=ids)

    def zero_grad(self) -> None:
        DataParallel.zero_grad(self)
        self._zero_expert_grads()

    def finish_grads(self) -> None:
        """DDP's reductions over dp, then the expert gradients summed over the replica group."""
        DataParallel.finish_grads(self)
        self._reduce_expert_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        dense = [p.grad for p in self.parameters() if p.grad is not None and id(p) not in self._expert_ids]
        return clip_grad_norm([(dense, []), (self._expert_grads(), [self.ep_group])], max_norm)

    def state_dict(self, optimizer=None):
        """Canonical state: expert parameters and their Adam moments gathered over ep."""
        msd, osd = DataParallel.state_dict(self, optimizer)
        return self._with_full_experts(msd, osd, optimizer)

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical state, keeping this rank's expert range."""
        msd = {k: self._slice(v) if k in self.expert_params else v for k, v in msd.items()}
        if osd is not None:
            state = {k: ({n: self._slice(x) if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                          for n, x in st.items()} if k in self.expert_params else st)
                     for k, st in osd["state"].items()}
            osd = {**osd, "state": state}
        DataParallel.load_state_dict(self, msd, osd, optimizer)

    def full_params(self):
        return self._full_experts(self.module)


class ExpertZero1(_ExpertShards, ZeroStrategy):
    """Native ZeRO-1 over ``dp_group`` for the non-expert parameters (flat buffers, optimizer state
    sharded over dp), expert parameters sharded over ``ep`` with their full Adam state in an extra
    optimizer group (module docstring). Args as :class:`ZeroStrategy` (stage 1) plus ``ep``."""

    def __init__(self, model, dp_group, ep: int, dtype: str = "fp32", reduce_dtype: str = "auto", mask=None):
        ids = self._shard(model, dp_group, ep)
        ZeroStrategy.__init__(self, model, dp_group, 1, dtype, reduce_dtype, mask, exclude=ids)
        self._attach()

    def zero_grad(self) -> None:
        ZeroStrategy.zero_grad(self)
        self._zero_expert_grads()

    def finish_grads(self) -> None:
        ZeroStrategy.finish_grads(self)
        self._reduce_expert_grads()

    def build_optimizer(self, tcfg, mask: dict | None = None):
        """ZeRO's AdamW over the master shards plus the expert parameters, grouped by their decay
        flag in ``mask`` (by id; matrices decay, ``parallel.optim.decay_mask``)."""
        opt = ZeroStrategy.build_optimizer(self, tcfg, mask)
        mask = mask or {}
        for decay in (True, False):
            ps = [p for p in self.expert_params.values() if mask.get(id(p), p.dim() >= 2) == decay]
            if ps:
                opt.add_param_group({"params": ps, "weight_decay": tcfg.weight_decay if decay else 0.0})
        return opt

    def clip_grad_norm(self, max_norm: float, outer=()) -> float:
        """ZeRO's shards summed over dp, the expert shards over ep; tp is 1 under ep (the plan)."""
        counted = [f for f in self.all_flats if self.count_tied or not f.is_tied]
        extra = [f.shard_grad for f in self.all_flats if not (self.count_tied or not f.is_tied)]
        parts = [([f.shard_grad for f in counted], [self.group]), (self._expert_grads(), [self.ep_group])]
        return clip_grad_norm(parts, max_norm, also_clip=extra)

    def model_state_bytes(self, optimizer) -> dict:
        out = dict(ZeroStrategy.model_state_bytes(self, optimizer))
        for k, v in self._expert_bytes(optimizer).items():
            out[k] = out.get(k, 0) + v
        out["total_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
        return out

    def state_dict(self, optimizer=None):
        msd, osd = ZeroStrategy.state_dict(self, optimizer)
        return self._with_full_experts(msd, osd, optimizer)

    def checkpoint_state(self, optimizer=None):
        msd, osd = ZeroStrategy.checkpoint_state(self, optimizer)
        return self._with_full_experts(msd, osd, optimizer)

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        ZeroStrategy.load_state_dict(self, msd, osd, optimizer)
        self._load_experts(msd, osd, optimizer)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        ZeroStrategy.load_checkpoint_state(self, msd, osd, optimizer)
        self._load_experts(msd, osd, optimizer)

    @contextlib.contextmanager
    def full_params(self, blocks: bool = True):
        with ZeroStrategy.full_params(self, blocks) as module, self._full_experts(module) as m:
            yield m
