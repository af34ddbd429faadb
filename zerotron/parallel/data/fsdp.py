"""PyTorch FSDP2 (``fully_shard``) as a comparison backend for ZeRO (``parallel.zero_impl = "fsdp2"``).
With ``parallel.dp_replicate > 1`` it runs over the 2-D (dp_rep, dp_shard) mesh: torch's HSDP.

``fully_shard`` is applied to every transformer block, then to the root module (embeddings, tied
LM head, final LayerNorm), over the dp sub-mesh. Stage 3 = ``reshard_after_forward=True``; stage 2
semantics = ``reshard_after_forward=False`` (parameters stay gathered between forward and backward).
FSDP2 averages gradients over dp (gloo has no PREMUL_SUM for a custom divide factor), so the loss is
divided by ``N_global / dp`` instead of ``N_global``: the average of dp-scaled gradients is the sum
zerotron's loss normalisation needs. Its collectives are torch's own, so they are not in ``comm.STATS``.

Module order: FSDP2 prefetches only what it recorded (backward follows the reverse of the forward
that just ran; no explicit forward prefetch is set), so skipped or reordered blocks are safe. One
torch 2.13 gap is closed here: a block whose forward never ran has no unsharded parameter, and the
no_sync post-backward reads it (AttributeError '_unsharded_param'), so every block is unsharded
once at set-up. As with torch, every dp rank must run the same blocks in the same order.
"""
from __future__ import annotations

import contextlib

import torch

from zerotron.distributed import comm
from zerotron.parallel import precision
from zerotron.parallel.base import Strategy
from zerotron.parallel.grad_norm import clip_grad_norm


class FSDP2Strategy(Strategy):
    """torch FSDP2 over the dp dimension of ``mesh``.

    Args: ``model`` (identically initialised CausalLM; each block of its layout is one FSDP unit), ``mesh`` (zerotron Mesh), ``stage`` (2 or 3),
    ``dtype`` ("fp32" | "bf16": bf16 compute with fp32 sharded parameters | "fp64"), ``reduce_dtype``
    (see ``parallel.precision``).
    Raises ValueError for stage 1 (FSDP2 has no optimizer-only sharding)."""

    def __init__(self, model, mesh, stage: int, dtype: str = "fp32", reduce_dtype: str = "auto"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if stage not in (2, 3):
            raise ValueError("parallel.zero_impl = fsdp2 supports zero_stage 2 or 3")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None,
                                  reduce_dtype=precision.reduce_dtype(dtype, reduce_dtype))
        # HSDP (parallel.dp_replicate > 1): FSDP2's 2-D (replicate, shard) mesh -- shards within
        # dp_shard, gradient shards all-reduced across dp_rep (torch's hybrid sharding)
        dp_mesh = mesh.hsdp_mesh if mesh.hsdp_mesh is not None else mesh.mesh["dp"]
        reshard = stage == 3
        blocks = list(model.blocks())
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        for block in blocks:
            # torch 2.13's no_sync post-backward reads every block's unsharded parameter, which only
            # exists once the block has been unsharded: a block whose forward never ran (skipped)
            # would raise AttributeError '_unsharded_param'. One gather at set-up creates them.
            block.unshard()
            block.reshard()
        self.module, self.group, self.loss_groups, self.stage = model, mesh.group("dp"), [mesh.group("dp")], stage
        self.shard_group = mesh.group("shard")  # the ranks whose local shards are disjoint

    def forward_backward(self, micro_batches, n_global, dtype, device):
        return super().forward_backward(micro_batches, n_global / self.group.size(), dtype, device)

    def eval_loss_sum(self, x, y, dtype, device):
        """Forward only; afterwards every FSDP module is resharded (with reshard_after_forward=False a
        gradient-free forward would otherwise leave stale unsharded parameters for the next step)."""
        out = super().eval_loss_sum(x, y, dtype, device)
        self._reshard()
        return out

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm from the DTensor gradient shards (each rank of the shard group -- dp, or
        dp_shard with HSDP -- holds different elements):
        :func:`zerotron.parallel.grad_norm.clip_grad_norm` over that group; clips in place."""
        return clip_grad_norm([([p.grad for p in self.parameters() if p.grad is not None], [self.shard_group])],
                              max_norm)

    def _get(self, optimizer, full: bool):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=full)
        if optimizer is None:
            return get_state_dict(self.module, [], options=opts)[0], None
        return get_state_dict(self.module, optimizer, options=opts)

    def _set(self, msd, osd, optimizer, full: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.module, optimizer or [], model_state_dict=msd, optim_state_dict=osd or {},
                       options=StateDictOptions(full_state_dict=full))

    def state_dict(self, optimizer=None):
        """Canonical (dense, FQN-keyed) model/optimizer state gathered from the DTensor shards."""
        return self._get(optimizer, full=True)

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical dense state; every rank keeps its shards."""
        self._set(msd, osd, optimizer, full=True)

    def checkpoint_state(self, optimizer=None):
        """The DTensor-sharded state (``full_state_dict=False``): each rank hands DCP only its
        shards; DCP records them as chunks of the global FQN-keyed tensors, so any layout (and a
        plain model) can load the files. Collective."""
        return self._get(optimizer, full=False)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load the sharded state DCP filled into :meth:`checkpoint_state`'s dicts."""
        self._set(msd, osd, optimizer, full=False)

    def reduce_loss(self, loss_sum: torch.Tensor) -> float:
        t = loss_sum.clone()
        comm.all_reduce(t, group=self.group, tag="metrics")
        return float(t)
