"""Tensor parallelism through PyTorch's DTensor API (``torch.distributed.tensor.parallel``): a
comparison backend for zerotron's own Megatron layers (``parallel.tp_impl = "dtensor"``).

Per block (Shoeybi et al. 2019, sec. 3): ``attn.c_attn`` and ``mlp.c_fc`` become
``ColwiseParallel`` (weight ``Shard(0)``: replicated input, local output columns),
``attn.c_proj`` and ``mlp.c_proj`` ``RowwiseParallel`` (weight ``Shard(1)``: local input, output
all-reduced to a replicated tensor). Embeddings, layer norms and the tied LM head stay replicated
plain tensors, so the logits (B, T, V) and the loss are the dense ones on every tp rank, and the
replicated parameters get identical gradients without any extra collective.

The fused ``c_attn`` rows are ordered [q | k | v]; a plain ``Shard(0)`` would hand rank 0 all of q
and part of k. The transform therefore permutes the rows to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
(rank r's heads contiguous) before sharding, and ``state_dict`` / ``load_state_dict`` undo / redo
the permutation, so checkpoints keep the canonical dense layout of every other strategy.

Supported: tp > 1 alone (dp = pp = 1, no ZeRO, no sequence parallelism, dropout 0 -- dropout in
the replicated regions would need DTensor's RNG tracker); ``config.validate`` refuses the rest.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..distributed import comm
from .base import Strategy
from .tp_model import TPCausalSelfAttention

__all__ = ["DTensorTPStrategy", "qkv_permutation"]


def qkv_permutation(n_embd: int, tp: int) -> torch.Tensor:
    """Row order of ``c_attn`` that makes each tp rank's ``Shard(0)`` chunk hold its own heads:
    new row i = old row perm[i], perm = [q_0, k_0, v_0, q_1, k_1, v_1, ...], each part n_embd/tp
    rows. Raises ValueError if tp does not divide n_embd."""
    if n_embd % tp:
        raise ValueError(f"tp={tp} must divide n_embd={n_embd}")
    w = n_embd // tp
    return torch.tensor([part * n_embd + r * w + j for r in range(tp) for part in range(3) for j in range(w)])


def _is_c_attn(name: str) -> bool:
    return ".attn.c_attn." in f".{name}"


class DTensorTPStrategy(Strategy):
    """A GPT tensor-parallelised in place with DTensor over ``tp_mesh`` (a 1-D DeviceMesh); see the
    module docstring. ``tp_group``: the matching ``comm.NamedGroup`` (gradient-norm reduction).
    Raises ValueError if tp does not divide n_head."""

    def __init__(self, model, tp_mesh, tp_group):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        cfg, n = model.config, tp_mesh.size()
        if cfg.n_head % n:
            raise ValueError(f"tensor parallel degree tp={n} must divide n_head={cfg.n_head}")
        self.module, self.tp_mesh, self.dt_group = model, tp_mesh, tp_group
        self.loss_groups = []  # every tp rank computes the same full loss
        self.perm = qkv_permutation(cfg.n_embd, n)
        self.inv = torch.empty_like(self.perm)
        self.inv[self.perm] = torch.arange(len(self.perm))
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
        with torch.no_grad():
            for block in model.transformer.h:
                lin = block.attn.c_attn
                lin.weight.copy_(lin.weight[self.perm])
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias[self.perm])
                # the native TP attention over local heads (its dropout RNG tracker is unused: dropout 0)
                block.attn.__class__ = TPCausalSelfAttention
                block.attn.n_head_local, block.attn.rng_tracker = cfg.n_head // n, None
                parallelize_module(block, tp_mesh, plan)

    # ---- gradients -------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm: squares of the sharded DTensor gradients' local shards summed over tp,
        plus the replicated gradients once; clip in place when ``max_norm > 0``."""
        from torch.distributed.tensor import DTensor, Shard

        grads = [q.grad for q in self.parameters() if q.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        is_sharded = [isinstance(g, DTensor) and any(isinstance(p, Shard) for p in g.placements) for g in grads]
        sq = torch.stack([t.double().pow(2).sum() for t in local])  # one device tensor, no per-grad sync
        mask = torch.tensor(is_sharded, device=sq.device)
        sums = torch.stack([sq[mask].sum(), sq[~mask].sum()])
        comm.all_reduce(sums[:1], group=self.dt_group, tag="tp_grad_norm")  # shards: summed over tp
        norm = math.sqrt(float(sums.sum()))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for t in local:
                t.mul_(coef)
        return norm

    def build_optimizer(self, tcfg, mask: dict):
        """AdamW with ``foreach=False`` (its grouped kernels do not take DTensor and plain tensor
        parameters in one list)."""
        opt = super().build_optimizer(tcfg, mask)
        for g in opt.param_groups:
            g["foreach"] = False
        return opt

    # ---- canonical state ---------------------------------------------------------------------
    @staticmethod
    def _rows(v, index: torch.Tensor):
        return v[index.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    def _reorder(self, sd: dict, index: torch.Tensor) -> dict:
        """``sd`` (FQN -> tensor) with the c_attn entries' rows taken in ``index`` order."""
        return {k: self._rows(v, index) if _is_c_attn(k) else v for k, v in sd.items()}

    def _reorder_state(self, state: dict, index: torch.Tensor) -> dict:
        """Optimizer ``state`` (FQN -> {"step", "exp_avg", ...}) likewise: every c_attn moment."""
        return {fqn: {k: self._rows(v, index) for k, v in st.items()} if _is_c_attn(fqn) else st
                for fqn, st in state.items()}

    def state_dict(self, optimizer=None):
        """Canonical dense state (DTensors gathered with ``full_tensor``, c_attn rows back in
        [q | k | v] order). Collective over tp."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True)
        if optimizer is None:
            return self._reorder(get_state_dict(self.module, [], options=opts)[0], self.inv), None
        msd, osd = get_state_dict(self.module, optimizer, options=opts)
        return self._reorder(msd, self.inv), {**osd, "state": self._reorder_state(osd["state"], self.inv)}

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical dense state: c_attn rows permuted, then each rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True)
        msd = self._reorder(msd, self.perm)
        if optimizer is None or osd is None:
            set_state_dict(self.module, [], model_state_dict=msd, optim_state_dict={}, options=opts)
            return
        state = self._reorder_state(osd["state"], self.perm)
        set_state_dict(self.module, optimizer, model_state_dict=msd, optim_state_dict={**osd, "state": state},
                       options=opts)
        for g in optimizer.param_groups:  # the saved groups carry another layout's foreach setting
            g["foreach"] = False

    def full_params(self):
        """The module itself: its forward returns dense logits on every tp rank (collective)."""
        return contextlib.nullcontext(self.module)
