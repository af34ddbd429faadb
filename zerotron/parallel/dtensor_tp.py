"""Tensor parallelism through PyTorch's DTensor API (``torch.distributed.tensor.parallel``): a
comparison backend for zerotron's own Megatron layers (``parallel.tp_impl = "dtensor"``).

Per block (Shoeybi et al. 2019, sec. 3), as the model's layout (``model.layout().block_tp``) says:
column-split Linear modules become ``ColwiseParallel`` (weight ``Shard(0)``: replicated input,
local output columns), row-split ones ``RowwiseParallel`` (weight ``Shard(1)``: local input, output
all-reduced to a replicated tensor). Embeddings, norms and the LM head stay replicated plain
tensors, so the logits (B, T, V) and the loss are the dense ones on every tp rank, and the
replicated parameters get identical gradients without any extra collective.

A fused column Linear of ``chunks`` parts (e.g. a fused [q | k | v]) would, under a plain ``Shard(0)``,
hand rank 0 all of q and part of k. The transform therefore permutes its rows to
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank r's heads contiguous) before sharding, and ``state_dict`` /
``load_state_dict`` undo / redo the permutation, so checkpoints keep the canonical dense layout of
every other strategy.

Supported: tp > 1 alone (dp = pp = 1, no ZeRO, no sequence parallelism, dropout 0 -- dropout in
the replicated regions would need DTensor's RNG tracker); the plan (``zerotron.plan``) refuses the rest.
"""
from __future__ import annotations

import contextlib

import torch

from zerotron.models.layout import get_module
from zerotron.parallel.base import Strategy
from zerotron.parallel.grad_norm import clip_grad_norm

__all__ = ["DTensorTPStrategy", "chunk_permutation"]


def chunk_permutation(out_features: int, chunks: int, tp: int) -> torch.Tensor:
    """Row order of a fused Linear of ``chunks`` equal parts (out_features rows in all) that makes
    each tp rank's ``Shard(0)`` chunk hold its own rows of every part: new row i = old row perm[i],
    perm = [p0_0, p1_0, p2_0, p0_1, ...] (part p, rank r: rows of size out_features/chunks/tp).
    Raises ValueError if chunks * tp does not divide out_features."""
    if out_features % (chunks * tp):
        raise ValueError(f"tp={tp} x {chunks} parts must divide out_features={out_features}")
    part, w = out_features // chunks, out_features // chunks // tp
    return torch.tensor([c * part + r * w + j for r in range(tp) for c in range(chunks) for j in range(w)])


class DTensorTPStrategy(Strategy):
    """A model tensor-parallelised in place with DTensor over ``tp_mesh`` (a 1-D DeviceMesh) as its
    ``layout()`` says; see the module docstring. ``tp_group``: the matching ``comm.NamedGroup``
    (gradient-norm reduction). Raises ValueError if tp does not divide a size of the layout's
    ``tp_divides``."""

    def __init__(self, model, tp_mesh, tp_group):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        lay, n = model.layout(), tp_mesh.size()
        lay.check_tp(n)
        self.module, self.tp_mesh, self.dt_group = model, tp_mesh, tp_group
        self.loss_groups = []  # every tp rank computes the same full loss
        self.perms: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # param FQN -> (perm, inverse)
        plan = {path: ColwiseParallel() if rule.style == "column" else RowwiseParallel()
                for path, rule in lay.block_tp.items()}
        with torch.no_grad():
            for i, block in enumerate(get_module(model, lay.blocks)):
                for path, rule in lay.block_tp.items():
                    if rule.chunks == 1:
                        continue
                    lin = get_module(block, path)
                    perm = chunk_permutation(lin.out_features, rule.chunks, n)
                    inv = torch.empty_like(perm)
                    inv[perm] = torch.arange(len(perm))
                    for pname, t in lin.named_parameters():
                        t.copy_(t[perm])
                        self.perms[f"{lay.blocks}.{i}.{path}.{pname}"] = (perm, inv)
                parallelize_module(block, tp_mesh, plan)  # attention derives its local heads from shapes

    # ---- gradients -------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm: squares of the sharded DTensor gradients' local shards summed over tp,
        plus the replicated gradients once; clip in place when ``max_norm > 0``
        (:func:`zerotron.parallel.grad_norm.clip_grad_norm`)."""
        from torch.distributed.tensor import DTensor, Shard

        grads = [q.grad for q in self.parameters() if q.grad is not None]
        sharded = [isinstance(g, DTensor) and any(isinstance(p, Shard) for p in g.placements) for g in grads]
        return clip_grad_norm([([g for g, s in zip(grads, sharded) if s], [self.dt_group]),
                               ([g for g, s in zip(grads, sharded) if not s], [])], max_norm)

    def build_optimizer(self, tcfg, mask: dict):
        """AdamW with ``foreach=False`` and ``fused=False`` whatever ``train.optimizer_impl`` says
        (their grouped kernels do not take DTensor and plain tensor parameters in one list)."""
        opt = super().build_optimizer(tcfg, mask)
        for g in opt.param_groups:
            g["foreach"], g["fused"] = False, False
        return opt

    # ---- canonical state ---------------------------------------------------------------------
    @staticmethod
    def _rows(v, index: torch.Tensor):
        return v[index.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    def _reorder(self, sd: dict, which: int) -> dict:
        """``sd`` (FQN -> tensor) with the fused entries' rows taken in perm (``which`` 0) or inverse
        (1) order."""
        return {k: self._rows(v, self.perms[k][which]) if k in self.perms else v for k, v in sd.items()}

    def _reorder_state(self, state: dict, which: int) -> dict:
        """Optimizer ``state`` (FQN -> {"step", "exp_avg", ...}) likewise: every fused moment."""
        return {fqn: {k: self._rows(v, self.perms[fqn][which]) for k, v in st.items()} if fqn in self.perms
                else st for fqn, st in state.items()}

    def state_dict(self, optimizer=None):
        """Canonical dense state (DTensors gathered with ``full_tensor``, fused rows back in
        [q | k | v] order). Collective over tp."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True)
        if optimizer is None:
            return self._reorder(get_state_dict(self.module, [], options=opts)[0], 1), None
        msd, osd = get_state_dict(self.module, optimizer, options=opts)
        return self._reorder(msd, 1), {**osd, "state": self._reorder_state(osd["state"], 1)}

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical dense state: fused rows permuted, then each rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True)
        msd = self._reorder(msd, 0)
        if optimizer is None or osd is None:
            set_state_dict(self.module, [], model_state_dict=msd, optim_state_dict={}, options=opts)
            return
        state = self._reorder_state(osd["state"], 0)
        set_state_dict(self.module, optimizer, model_state_dict=msd, optim_state_dict={**osd, "state": state},
                       options=opts)
        for g in optimizer.param_groups:  # the saved groups carry another layout's foreach setting
            g["foreach"] = False

    def full_params(self):
        """The module itself: its forward returns dense logits on every tp rank (collective)."""
        return contextlib.nullcontext(self.module)
