"""torch's own gradient synchronisers applied to the stages of a native pipeline: torch DDP and FSDP2.

A pipeline applies the same gradient sync to its stages as the plain runner applies to the whole
model (torchtitan: split into stages first, then parallelize each stage). These two drive torch's
wrappers the way ``torch.distributed.pipelining`` does (``PipelineStage.backward_maybe_with_nosync``
and ``perform_reduce_grad`` in torch/distributed/pipelining/stage.py), but under zerotron's executor:

* :class:`StageTorchDDP` (``parallel.dp_impl = torch``): one ``DistributedDataParallel`` per local
  chunk (model stage) over the chunk's modules (:class:`ChunkModule`), each a
  :class:`~zerotron.parallel.data.ddp.TorchDDP` (SUM comm hook through ``comm``, the per-window
  unused-parameter check). Backwards before a chunk's last one run inside its ``no_sync``; before the
  last one the reducer is armed with ``reducer.prepare_for_backward(outputs)`` (what DDP's own forward
  does outside ``no_sync``; the chunk's forward does not go through DDP), so its buckets all-reduce
  during that backward. A parameter shared by two chunks of one rank (the tied embedding/head when a
  rank holds the first and the last model stage) belongs to the chunk of the earlier model stage,
  whose last backward comes last; the other chunk's DDP ignores it.
* :class:`StageFSDP2` (``parallel.zero_impl = fsdp2``, ZeRO-2 or 3): ``fully_shard`` on each local
  block, then on one root over all of this rank's chunks (:class:`RankModule`: embedding and head
  modules of the chunks it holds, the tied copy included, one FSDP unit), as
  :class:`~zerotron.parallel.data.fsdp.FSDP2Strategy` does for the whole model (its state-dict, tp
  and norm code is reused). Every backward of the step runs without gradient sync and without
  reshard-after-backward (gradients accumulate unsharded, as torch's pipelining does); after the
  step's last backward, :meth:`StageFSDP2.end_step` runs each FSDP unit's post-backward with sync
  on (one reduce-scatter per unit) and FSDP2's final callback. Because the reduction runs after all
  backwards, a split backward (B now, W later: zb-h1, zb-v) composes: the split takes its weight
  targets from the graph (FSDP2 computes with its unsharded parameters, not the modules' DTensors),
  and :meth:`StageFSDP2.weight_context` gathers the chunk's units again before a W (ZeRO-3 resharded
  them after any forward since the B). FSDP2 averages over dp, so the loss is pre-scaled by dp
  (``loss_scale``). The root lists both modules of each tied pair, so FSDP2 registers its sharded
  parameter under both names (shared parameters are FSDP2's own feature) and the dense model stays
  tied; :meth:`StageFSDP2.gathered` (``full_params``) swaps full plain copies in and out itself
  rather than unsharding the units, because FSDP2's state-dict pre-hook re-registers the sharded
  parameters of a unit it finds unsharded and frees the unsharded storage a caller may hold.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn

from zerotron.models.layout import get_module
from zerotron.parallel.base import unique_params
from zerotron.parallel.data.ddp import TorchDDP

__all__ = ["ChunkModule", "RankModule", "StageTorchDDP", "StageFSDP2", "chunk_module_names"]


def chunk_module_names(stage_model, chunk: int) -> list[str]:
    """Dotted names (in ``stage_model``) of the modules local chunk ``chunk`` runs: the layout's
    embedding modules on model stage 0, the chunk's blocks, the layout's head on the last stage."""
    lay, s = stage_model.layout(), stage_model.stages[chunk]
    names = (list(lay.embedding) if s == 0 else []) + [f"{lay.blocks}.{i}" for i in stage_model.layer_ranges[s]]
    if s == stage_model.last_stage:
        names += list(lay.head)
    return names


class ChunkModule(nn.Module):
    """The modules of one local chunk of a ``StageModel`` as a module of their own (shared, no
    copies; not registered in the StageModel, whose FQNs stay the dense model's), so a wrapper
    (torch DDP) sees exactly the chunk's parameters. ``forward(x)`` = ``run_chunk(chunk, x)``."""

    def __init__(self, stage_model, chunk: int):
        super().__init__()
        self.parts = nn.ModuleList([get_module(stage_model, n) for n in chunk_module_names(stage_model, chunk)])
        object.__setattr__(self, "_stage_model", stage_model)
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stage_model.run_chunk(self.chunk, x)


class RankModule(nn.Module):
    """Every module of this rank's chunks as one module (FSDP2's root unit: the non-block
    parameters of all local chunks, so a tied pair on one rank is one parameter of one unit), plus,
    on a rank with the first or the last stage, both modules of each tied pair.
    ``forward(x, chunk)`` = ``run_chunk(chunk, x)``: tokens (b, T) or activations (b, T, C) in,
    activations or logits out."""

    def __init__(self, stage_model):
        super().__init__()
        names = [n for c in range(len(stage_model.stages)) for n in chunk_module_names(stage_model, c)]
        parts = [get_module(stage_model, n) for n in dict.fromkeys(names)]
        if stage_model.holds(0) or stage_model.holds(stage_model.last_stage):
            # both modules of each tied pair (from the dense model), so fully_shard registers the new
            # parameter under both names there too and the dense model stays tied (full_params)
            dense = stage_model._dense
            parts += [get_module(dense, n.rpartition(".")[0]) for pair in stage_model.layout().tied for n in pair]
        self.parts = nn.ModuleList(list({id(m): m for m in parts}.values()))
        object.__setattr__(self, "_stage_model", stage_model)

    def forward(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        return self._stage_model.run_chunk(chunk, x)


class StageTorchDDP:
    """torch DDP per local chunk of ``stage_model`` over ``group`` (the dp ``comm.NamedGroup``);
    see the module docstring. ``bucket_mb`` (MiB), ``find_unused_parameters`` as for
    :class:`~zerotron.parallel.data.ddp.TorchDDP`. Attributes: ``units`` (one TorchDDP per chunk)."""

    def __init__(self, stage_model, group, bucket_mb: float, find_unused_parameters: bool = False):
        self.module = stage_model
        order = sorted(range(len(stage_model.stages)), key=lambda c: stage_model.stages[c])
        owner: dict[int, int] = {}  # id(param) -> chunk whose DDP reduces it (the earliest model stage)
        for c in order:
            for q in unique_params(ChunkModule(stage_model, c)):
                owner.setdefault(id(q), c)
        self.units: list[TorchDDP] = []
        for c in range(len(stage_model.stages)):
            mod = ChunkModule(stage_model, c)
            ignore = [n for n, q in mod.named_parameters() if owner[id(q)] != c]
            self.units.append(TorchDDP(mod, group, bucket_mb=bucket_mb, find_unused_parameters=find_unused_parameters,
                                       ignore=ignore))
        self._out: dict[int, weakref.ref] = {}
        self.loss_scale = 1  # DDP sums

    def begin_step(self) -> None:
        """Nothing to arm: each chunk's reducer is armed at its last backward."""

    def end_step(self) -> None:
        """Nothing left: the reductions ran inside the last backwards."""

    def forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """The chunk's forward (not through DDP: the reducer is armed at its last backward); keeps a
        weak reference to the output for :meth:`backward_context` (find_unused_parameters walks
        the graph from it)."""
        out = self.module.run_chunk(chunk, x)
        if torch.is_grad_enabled():
            self._out[chunk] = weakref.ref(out)
        return out

    def backward_context(self, chunk: int, sync: bool):
        """Context of one backward of ``chunk``: its DDP's ``no_sync`` unless ``sync`` (the chunk's
        last backward of the step), which arms the reducer first (torch's pipelining does the same)."""
        unit = self.units[chunk]
        if not sync:
            return unit.no_sync()
        ref = self._out.get(chunk)
        out = ref() if ref is not None else None
        from torch.nn.parallel.distributed import _find_tensors

        unit.ddp.reducer.prepare_for_backward(list(_find_tensors(out)) if out is not None else [])
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for u in self.units:
                stack.enter_context(u.no_sync())
            yield

    def finish_grads(self) -> None:
        """torch DDP's backward waited for its reductions; raises ConfigError (TorchDDP's check) if
        a chunk parameter got no gradient in its synchronised backward."""
        for u in self.units:
            u.finish_grads()
        self._out.clear()

    def zero_grad(self) -> None:
        for u in self.units:
            u.zero_grad()


class StageFSDP2:
    """FSDP2 (``fully_shard``) over the dp group of ``mesh`` for this rank's stages; see the module
    docstring. Args: ``stage_model`` (the StageModel; its blocks and a :class:`RankModule` root
    are sharded, its parameters become DTensors), ``mesh``, ``stage`` (2: reshard_after_forward
    False, 3: True), ``dtype``, ``reduce_dtype``, ``offload`` (CPUOffloadPolicy, as
    :class:`~zerotron.parallel.data.fsdp.FSDP2Strategy`). Attributes: ``fsdp`` (the
    :class:`~zerotron.parallel.data.fsdp.FSDP2Strategy` whose state-dict/norm helpers are reused),
    ``root``, ``shard_group``, ``loss_scale`` (dp: FSDP2 averages, the loss is divided by
    N_global / dp)."""

    def __init__(self, stage_model, mesh, stage: int, dtype: str, reduce_dtype: str, offload: bool = False):
        from zerotron.parallel.data.fsdp import FSDP2Strategy

        self.module = stage_model
        self.root = RankModule(stage_model)
        self.fsdp = FSDP2Strategy(stage_model, mesh, stage, dtype, reduce_dtype,
                                  units=list(stage_model.blocks_here.values()), root=self.root, offload=offload)
        self.shard_group = self.fsdp.shard_group
        self.loss_scale = self.fsdp.group.size()
        self.act_dtype = torch.bfloat16 if dtype == "bf16" else None  # stage outputs in FSDP2's param dtype

    def forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """The chunk's forward through the FSDP root (its pre-forward gathers the root unit)."""
        return self.root(x, chunk)

    def backward_context(self, chunk: int, sync: bool):
        """Every backward alike (no sync until :meth:`end_step`)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def weight_context(self, mb: int, chunk: int):
        """Around a W (split backward: zb-h1, zb-v): the chunk's block units, and the root when the
        chunk runs the embedding or the head, gathered again first (with ZeRO-3 a forward since
        the chunk's B resharded them, and W's saved tensors read the unsharded parameters'
        storage; a no-op for units still gathered); the gradients accumulate unsharded as in any
        backward of the step."""
        stage = self.module.stages[chunk]
        for i in self.module.layer_ranges[stage]:
            self.module.blocks_here[str(i)].unshard()
        if stage in (0, self.module.last_stage):
            self.root.unshard()
        yield

    def _units(self):
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)] + [self.root]

    def begin_step(self) -> None:
        """Every backward of the step accumulates unsharded gradients, no reduction, no reshard."""
        self.root.set_is_last_backward(False)
        self.root.set_reshard_after_backward(False)
        self.root.set_requires_gradient_sync(False)

    def end_step(self) -> None:
        """After the step's last backward: each unit's post-backward with sync on (reduce-scatter,
        reshard), then FSDP2's root final callback (torch's ``perform_reduce_grad``)."""
        from torch.distributed.fsdp import fully_shard

        self.root.set_is_last_backward(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_requires_gradient_sync(True)
        state = fully_shard.state(self.root)
        for st in state._state_ctx.all_states:
            for group in st._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def reshard(self) -> None:
        """Free every unit's unsharded parameters (after a gradient-free forward)."""
        for m in self._units():
            m.reshard()

    @contextlib.contextmanager
    def gathered(self):
        """Every DTensor parameter of this rank's modules (the tied pair's two modules included)
        replaced, for the context, by a plain Parameter holding its full tensor (all-gathered over
        dp, one collective per parameter in module order, the same on every dp rank; a shared
        parameter gathered once and registered under each of its names; ``tp_shard`` records kept);
        the DTensors registered again on exit. FSDP2's own state stays sharded, so its state-dict
        pre-hook (which re-registers the sharded parameters of a unit it finds unsharded) cannot
        free a tensor a caller already holds. Collective over dp."""
        from torch.distributed.tensor import DTensor

        self.reshard()  # FSDP2's state sharded (a no-op after a step or a forward-only pass)
        full: dict[int, nn.Parameter] = {}
        swapped = []  # (module, name, DTensor parameter)
        try:
            for mod in self.root.modules():
                for name, q in list(mod._parameters.items()):
                    if not isinstance(q, DTensor):
                        continue
                    if id(q) not in full:
                        t = nn.Parameter(q.full_tensor().detach(), requires_grad=q.requires_grad)
                        if hasattr(q, "tp_shard"):
                            t.tp_shard = q.tp_shard
                        full[id(q)] = t
                    swapped.append((mod, name, q))
                    mod._parameters[name] = full[id(q)]
            yield
        finally:
            for mod, name, q in swapped:
                mod._parameters[name] = q

    @contextlib.contextmanager
    def no_sync(self):
        self.root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(True)

    def finish_grads(self) -> None:
        """Nothing left: the reduce-scatter completed in :meth:`end_step`."""

    def zero_grad(self) -> None:
        for q in unique_params(self.module):
            q.grad = None
