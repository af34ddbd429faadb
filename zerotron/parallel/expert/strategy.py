"""Expert parallelism with native DDP: :class:`ExpertDataParallel`.

Groups (carved out of the dp group, as torchtitan does): dp rank d has ep coordinate ``d % ep``;
the ep group of d is ``{d - d % ep, ..., d - d % ep + ep - 1}`` (consecutive dp ranks: the all-to-all
stays among neighbours), its expert-replica group ``{d' : d' % ep == d % ep}`` (dp/ep ranks holding
the same experts). Non-expert parameters are data parallel over all of dp (native bucketed DDP);
expert parameters are sharded over ep and their gradients summed over the replica group -- after
the dispatch backward they already hold the sum over their ep group's tokens, so the result is the
sum over every dp rank's tokens, with the loss normalised by the global target count as everywhere
(``parallel.base``). Gradient norm: expert shards' squares summed over ep (disjoint), the rest once.
The canonical state (checkpoints, parity) holds full expert tensors, gathered over ep.

The groups live here while ep composes with data parallelism alone (the plan refuses pp, tp, cp,
HSDP with ep); they belong in ``distributed.mesh`` once it does.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.parallel.data.ddp import DataParallel
from zerotron.parallel.expert.dispatch import local_dispatch, shard_experts
from zerotron.parallel.grad_norm import clip_grad_norm

__all__ = ["ExpertDataParallel", "expert_groups"]


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


class ExpertDataParallel(DataParallel):
    """Native DDP over ``dp_group`` for the non-expert parameters, expert parameters sharded over
    ``ep`` (see the module docstring). Args: ``model`` (dense, identically initialised on every
    rank: it is sharded here), ``dp_group``, ``ep``, ``bucket_mb``, ``src_rank`` as DataParallel."""

    def __init__(self, model, dp_group, ep: int, bucket_mb: float = 25.0, src_rank: int = 0):
        self.ep_group, self.rep_group, self.ep_rank = expert_groups(dp_group, ep)
        self.ep = ep
        self.expert_params = shard_experts(model, model.layout(), self.ep_rank, ep, self.ep_group)
        ids = frozenset(id(p) for p in self.expert_params.values())
        self._expert_ids = ids
        DataParallel.__init__(self, model, dp_group, bucket_mb=bucket_mb, src_rank=src_rank, exclude=ids)
        plist = list(self.expert_params.values())
        self._ebuf = torch.zeros(sum(p.numel() for p in plist), dtype=plist[0].dtype, device=plist[0].device)
        self._attach()

    def _attach(self) -> None:
        off = 0
        for p in self.expert_params.values():
            p.grad = self._ebuf[off:off + p.numel()].view_as(p)
            off += p.numel()

    def zero_grad(self) -> None:
        DataParallel.zero_grad(self)
        self._ebuf.zero_()
        self._attach()

    def finish_grads(self) -> None:
        """DDP's reductions over dp, then the expert gradients summed over the replica group."""
        DataParallel.finish_grads(self)
        if self.rep_group.size() > 1:
            comm.all_reduce(self._ebuf, group=self.rep_group, tag="grad")

    def clip_grad_norm(self, max_norm: float) -> float:
        dense = [p.grad for p in self.parameters() if p.grad is not None and id(p) not in self._expert_ids]
        experts = [p.grad for p in self.expert_params.values()]
        return clip_grad_norm([(dense, []), (experts, [self.ep_group])], max_norm)

    # ---- full tensors over ep -------------------------------------------------------------------
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's expert slice (E/ep, ...) -> the full (E, ...) tensor. Collective over ep."""
        t = t.detach().contiguous()
        out = t.new_empty((self.ep * t.size(0),) + tuple(t.shape[1:]))
        comm.all_gather(out.view(-1), t.view(-1), group=self.ep_group, tag="state")
        return out

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        n = t.size(0) // self.ep
        return t[self.ep_rank * n:(self.ep_rank + 1) * n].clone()

    def state_dict(self, optimizer=None):
        """Canonical state: expert parameters and their Adam moments gathered over ep."""
        msd, osd = DataParallel.state_dict(self, optimizer)
        for name in self.expert_params:
            msd[name] = self._gather(msd[name])
            if osd is not None and name in osd["state"]:
                osd["state"][name] = {k: self._gather(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                      for k, v in osd["state"][name].items()}
        return msd, osd

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical state, keeping this rank's expert range."""
        msd = {k: self._slice(v) if k in self.expert_params else v for k, v in msd.items()}
        if osd is not None:
            state = {k: ({n: self._slice(x) if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                          for n, x in st.items()} if k in self.expert_params else st)
                     for k, st in osd["state"].items()}
            osd = {**osd, "state": state}
        DataParallel.load_state_dict(self, msd, osd, optimizer)

    @contextlib.contextmanager
    def full_params(self):
        """The model with every expert on this rank and the local dispatch (evaluation by one rank,
        generation, export); gathered over ep on entry (collective), restored on exit."""
        from zerotron.models.layout import get_module

        layout = self.module.layout()
        local = {n: p.data for n, p in self.expert_params.items()}
        hooks = [(m, m.dispatch) for m in (get_module(b, layout.experts.moe)
                                           for b in get_module(self.module, layout.blocks))]
        full = {n: self._gather(p.data) for n, p in self.expert_params.items()}
        try:
            for n, p in self.expert_params.items():
                p.data = full[n]
            for m, _ in hooks:
                m.dispatch = local_dispatch
            yield self.module
        finally:
            for n, p in self.expert_params.items():
                p.data = local[n]
            for m, hook in hooks:
                m.dispatch = hook
