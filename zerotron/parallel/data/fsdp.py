"""PyTorch FSDP2 (``fully_shard``) as a comparison backend for ZeRO (``parallel.zero_impl = "fsdp2"``).
With ``parallel.dp_replicate > 1`` it runs over the 2-D (dp_rep, dp_shard) mesh: torch's HSDP.

``fully_shard`` is applied to every transformer block, then to the root module (embeddings, tied
LM head, final LayerNorm), over the dp sub-mesh. Stage 3 = ``reshard_after_forward=True``; stage 2
semantics = ``reshard_after_forward=False`` (parameters stay gathered between forward and backward).
FSDP2 averages gradients over dp (gloo has no PREMUL_SUM for a custom divide factor), so the loss is
divided by ``N_global / dp`` instead of ``N_global``: the average of dp-scaled gradients is the sum
zerotron's loss normalisation needs. Its collectives are torch's own; its all-gathers and
reduce-scatters are counted in ``comm.STATS`` through FSDP2's custom-comm hooks
(``parallel.data.fsdp_comm``, tag "fsdp2"; HSDP's replica all-reduce is not).

Module order: FSDP2 prefetches only what it recorded (backward follows the reverse of the forward
that just ran; no explicit forward prefetch is set), so skipped or reordered blocks are safe. One
torch 2.13 gap is closed here: a block whose forward never ran has no unsharded parameter, and the
no_sync post-backward reads it (AttributeError '_unsharded_param'), so every block is unsharded
once at set-up. As with torch, every dp rank must run the same blocks in the same order.

Tensor parallelism (``parallel.tp > 1``, native TP of ``parallel.tensor``, +- sequence parallel;
torchtitan's default 2-D layout): ``apply_tensor_parallel`` has already cut every sharded weight to
its plain tp-local tensor, and FSDP2 then shards each tp-local tensor (its dim 0) over the dp
sub-mesh of this rank's tp coordinate, so a rank holds a 1/(dp*tp) piece of each sharded tensor and
a 1/dp piece of each tp-replicated one (Zhao et al. 2023 for FSDP; the same composition as
torchtitan, without DTensor on the tp side). The vocab-parallel loss and the tp collectives inside
the layers run as without FSDP2. ``fully_shard`` makes new parameter objects, so the tp shard
records (``param.tp_shard``) are re-attached by name. After FSDP2's reduce-scatter (complete when
backward returns), :meth:`finish_grads` sums the tp-replicated gradients' dp shards over tp
(sequence parallel; each tp rank of one dp coordinate holds the same elements); the gradient norm
sums squares over the dp shard group and, for tp shards, over tp; checkpoints are the canonical
dense state, gathered over dp (FSDP2's full state dict) then over tp.
"""
from __future__ import annotations

import contextlib

import torch

from zerotron.distributed import comm
from zerotron.models.deferred import materialise_params
from zerotron.models.layout import scale_aux_losses
from zerotron.parallel import precision
from zerotron.parallel.base import Strategy
from zerotron.parallel.data.fsdp_comm import count_fsdp_collectives
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.tensor.layers import full_tensor, is_tp_sharded, local_shard


class FSDP2Strategy(Strategy):
    """torch FSDP2 over the dp dimension of ``mesh``.

    Args: ``model`` (identically initialised CausalLM; each block of its layout is one FSDP unit), ``mesh`` (zerotron Mesh), ``stage`` (2 or 3),
    ``dtype`` ("fp32" | "bf16": bf16 compute with fp32 sharded parameters | "fp64"), ``reduce_dtype``
    (see ``parallel.precision``). A tensor-parallel ``model`` (``model.tp_group`` set by
    ``apply_tensor_parallel``) has its tp-local tensors sharded over dp (see the module docstring).
    ``units``/``root`` (a pipeline's stage, ``pipeline.stage_sync``): the blocks to shard as units
    and the module to shard as root instead of ``model.blocks()`` and ``model`` (``model`` then only
    names the parameters, for state dicts). ``offload`` (``train.offload = params``): every unit
    gets torch's ``CPUOffloadPolicy`` (sharded parameters, their gradients and the optimizer step
    on the host, pinned on CUDA; FSDP2 copies a unit's shards to the device for its all-gather and
    its gradient shards back after the reduce-scatter). Raises ValueError for stage 1 (FSDP2 has no
    optimizer-only sharding)."""

    def __init__(self, model, mesh, stage: int, dtype: str = "fp32", reduce_dtype: str = "auto",
                 units: list | None = None, root=None, offload: bool = False):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if stage not in (2, 3):
            raise ValueError("parallel.zero_impl = fsdp2 supports zero_stage 2 or 3")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None,
                                  reduce_dtype=precision.reduce_dtype(dtype, reduce_dtype))
        # HSDP (parallel.dp_replicate > 1): FSDP2's 2-D (replicate, shard) mesh -- shards within
        # dp_shard, gradient shards all-reduced across dp_rep (torch's hybrid sharding)
        dp_mesh = mesh.hsdp_mesh if mesh.hsdp_mesh is not None else mesh.device_mesh("shard")  # dp_shard x cp
        reshard = stage == 3
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
        tp_group = getattr(model, "tp_group", None)
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        # name -> TPShard of every tp-sharded parameter (tied names too): fully_shard drops attributes
        self._tp_shards = {n: p.tp_shard for n, p in model.named_parameters(remove_duplicate=False)
                           if is_tp_sharded(p)}
        blocks = list(model.blocks()) if units is None else units
        # modules sharded over a mesh of their own first (expert parallelism: the experts over dp/ep);
        # the blocks' fully_shard then leaves their parameters to them. A deferred-init (meta) block gets
        # its dense values just before it is sharded (all blocks first when inner modules shard across them)
        if type(self)._shard_inner is not FSDP2Strategy._shard_inner:
            materialise_params([q for block in blocks for q in block.parameters()])
        inner = self._shard_inner(blocks, reshard, mp)
        for block in blocks:
            materialise_params(list(block.parameters()))
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=policy)
        materialise_params(list((model if root is None else root).parameters()))
        fully_shard(model if root is None else root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=policy)
        count_fsdp_collectives([*blocks, model if root is None else root], mesh.group("shard"))
        for block in [*inner, *blocks]:
            # torch 2.13's no_sync post-backward reads every block's unsharded parameter, which only
            # exists once the block has been unsharded: a block whose forward never ran (skipped)
            # would raise AttributeError '_unsharded_param'. One gather at set-up creates them.
            block.unshard()
            block.reshard()
        # the batch group (dp x cp) = FSDP2's whole mesh: the gradient average is over it
        self.module, self.group, self.loss_groups, self.stage = model, mesh.group("batch"), [mesh.group("batch")], stage
        self.shard_group = mesh.group("shard")  # the ranks whose local shards are disjoint
        # the token loss is divided by N_global / dp (below): the MoE auxiliary losses, whose gradient
        # enters inside the backward, are scaled by dp alike (else averaged, not summed, over dp)
        scale_aux_losses(model, self.group.size())
        self._mark_tp_shards()

    def _shard_inner(self, blocks: list, reshard: bool, mp) -> list:
        """``fully_shard`` submodules of ``blocks`` over a mesh other than dp before the blocks
        themselves (whose units then exclude their parameters); returns them. None here
        (``parallel.expert.fsdp`` shards the experts over dp/ep)."""
        return []

    def _mark_tp_shards(self) -> None:
        """Re-attach ``tp_shard`` to the (DTensor) parameters that replaced the tp-sharded ones."""
        for n, p in self.module.named_parameters(remove_duplicate=False):
            if n in self._tp_shards:
                p.tp_shard = self._tp_shards[n]

    def finish_grads(self) -> None:
        """Sequence parallel: sum the tp-replicated gradients over tp. Their dp shards (DTensor
        local tensors) are final when backward returns (FSDP2 waits for its reduce-scatter in the
        root's post-backward), and every tp rank of a dp coordinate holds the same elements."""
        self.sync_tp_replicated()
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
        :func:`zerotron.parallel.grad_norm.clip_grad_norm` over that group; clips in place.
        With tensor parallelism the tp shards' squares are summed over tp too, the tp-replicated
        parameters' counted once (Megatron-LM's rule, ``parallel.grad_norm``)."""
        ps = [p for p in self.parameters() if p.grad is not None]
        return clip_grad_norm([([p.grad for p in ps if is_tp_sharded(p)], [self.shard_group, self.tp_group]),
                               ([p.grad for p in ps if not is_tp_sharded(p)], [self.shard_group])], max_norm)

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

    def _tp_map(self, tensors: dict, fn, params: dict | None = None) -> dict:
        """``{fqn: fn(param, tensor)}`` for the tp-sharded parameters' entries of ``tensors``, the
        rest unchanged. Entries that are one tensor (tied names) are converted once. ``params``:
        the module's ``{fqn: parameter}`` (remove_duplicate=False), when the caller has it."""
        params = dict(self.module.named_parameters(remove_duplicate=False)) if params is None else params
        done: dict = {}
        out = {}
        for k, v in tensors.items():
            p = params.get(k)
            if p is None or not is_tp_sharded(p) or not isinstance(v, torch.Tensor) or v.dim() == 0:
                out[k] = v
            else:
                if id(v) not in done:
                    done[id(v)] = fn(p, v)
                out[k] = done[id(v)]
        return out

    def state_dict(self, optimizer=None):
        """Canonical (dense, FQN-keyed) model/optimizer state gathered from the DTensor shards:
        over dp (FSDP2's full state dict), then, with tensor parallelism, over tp (one all-gather
        per sharded tensor, tag "tp_export"; padding rows dropped). Collective."""
        msd, osd = self._get(optimizer, full=True)
        if self.tp_group is None:
            return msd, osd
        gather = lambda p, v: full_tensor(p, self.tp_group, local=v)  # noqa: E731
        params = dict(self.module.named_parameters(remove_duplicate=False))
        msd = self._tp_map(msd, gather, params)
        if osd is not None:
            osd = {**osd, "state": {fqn: {k: self._tp_map({fqn: v}, gather, params)[fqn] for k, v in st.items()}
                                    for fqn, st in osd["state"].items()}}
        return msd, osd

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical dense state (any layout's :meth:`state_dict`); every rank keeps its
        shards: its tp slice (no communication), then FSDP2 keeps its dp shard of that."""
        if self.tp_group is not None:
            cut = lambda p, v: local_shard(p, v, self.tp_group)  # noqa: E731
            params = dict(self.module.named_parameters(remove_duplicate=False))
            msd = self._tp_map(msd, cut, params)
            if osd is not None:
                osd = {**osd, "state": {fqn: {k: self._tp_map({fqn: v}, cut, params)[fqn] for k, v in st.items()}
                                        for fqn, st in osd["state"].items()}}
        self._set(msd, osd, optimizer, full=True)
        self._mark_tp_shards()

    def checkpoint_state(self, optimizer=None):
        """The DTensor-sharded state (``full_state_dict=False``): each rank hands DCP only its
        shards; DCP records them as chunks of the global FQN-keyed tensors, so any layout (and a
        plain model) can load the files. With tensor parallelism the DTensors would describe
        tp-local tensors under the dense names, so the canonical dense :meth:`state_dict` is handed
        over instead (as the native tensor-parallel strategies do; DCP writes each key once).
        Collective."""
        if self.tp_group is not None:
            return self.state_dict(optimizer)
        return self._get(optimizer, full=False)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load the state DCP filled into :meth:`checkpoint_state`'s dicts."""
        if self.tp_group is not None:
            return self.load_state_dict(msd, osd, optimizer)
        self._set(msd, osd, optimizer, full=False)

    def reduce_loss(self, loss_sum: torch.Tensor) -> float:
        t = loss_sum.clone()
        comm.all_reduce(t, group=self.group, tag="metrics")
        return float(t)
