"""Pipeline parallelism over the mesh's "pp" dimension: stage split, schedules, tied weights.

``PipelineStrategy(model, mesh, plan)`` splits a fully initialised ``CausalLM`` (identical on every rank)
into ``pp * v`` model stages (v = ``parallel.virtual_stages`` for "interleaved" and "zb-v", else 1); pipeline
rank r holds the stages ``c*pp + r`` for its chunks c (Megatron-LM interleaving). Layers per
stage follow ``parallel.pp_split``: "auto" (default; balanced over FLOP estimates that count the
embedding on stage 0 and the head + loss on the last stage, ``pipeline.balance``; the same
min-max partition over the pp*v model stages when interleaved), "even" (equal counts, earlier
stages take the remainder) or explicit counts; with "auto" rank 0 prints the chosen split once. Model stage 0
also holds the layout's embedding modules, the last one its head modules (``model.layout()``).

The step runs in mixins beside this module: ``pipeline.flushes`` (schedules, the flushes of one step,
forward-only evaluation, timing), ``pipeline.grads`` (the gradient sums after the backward, the norm,
the optimizer) and ``pipeline.state`` (checkpoint state, ``full_params``).

Tied weights (the layout's ``tied`` pair, e.g. a head tied to the token embedding):
the first stage owns the parameter; the last stage holds its own copy, registered like the dense
model does under both names (the owner's module comes along). Their gradients are summed before
every optimizer step (group "pp_tied") and the gradient norm counts the tied weight once, so the
copies stay bitwise equal. Optimizer-state key choice: the dense model's AdamW state for the tied
weight is keyed by the owner name (``named_parameters`` de-duplicates to the first name); both
pipeline copies use that same key (identical values, DCP
stores it once), and ``state_dict`` lists the whole model's FQNs in every ``param_groups`` entry, so
checkpoints reshard between pp=1 and any pp (tested pp 1 <-> 2 -> 4).

3-D layouts (pp x dp x tp):
  * tensor parallel: ``parallelize`` applies ``tensor.transform.apply_tensor_parallel`` (no sequence
    parallel) to the dense model first and splits the TP model; every tp rank of a pipeline stage
    runs its shards, the p2p activations (b, T, C) are full and identical across the tp ranks, and
    each tp rank talks to the same tp rank of the neighbouring stage (the peer map keeps dp, tp).
    The last stage's loss is the vocab-parallel cross-entropy (``tensor.transform.tp_loss_sum``); the tied
    gradient sum runs per (dp, tp) coordinate (both copies are the same vocabulary shard); the
    norm sums squares of tp-sharded gradients over tp, counts tp-replicated ones once, and sums
    over pp; checkpoints are gathered to the dense canonical format (``full_tensor``, collective
    over tp in the fixed state-dict order) and sliced again on load (``shard_tensor``).
  * ZeRO over dp (``parallel.zero_stage = 1, 2, 3``): the inner DataParallel is replaced by the
    same native ZeRO driver the plain runner uses (``data.zero.ZeroSync``) over this rank's stages
    (units: the tied weight alone, the other non-block parameters, each block): ZeRO-1 accumulates
    full gradients locally over all flushes and reduce-scatters each flat buffer in finish_grads;
    ZeRO-2/3 reduce-scatter the units of the chunk a backward action (one micro-batch through one
    chunk, or its W) ran right after it and free the gradients; ZeRO-3 also keeps parameters
    sharded at rest, gathering blocks around their forward and backward (and for a W) and the root
    units for the step. Then HSDP (``parallel.dp_replicate > 1``: sharded over the shard group,
    shard gradients all-reduced across the replicas), the tied gradient shard summed between the
    first and last stage, AdamW on the fp32 master shards (per parameter for partly used buffers),
    one all-gather of the updated parameters. Sequence parallelism: stage boundaries carry (b, T/tp,
    C) shards, and finish_grads sums the replicated parameters' gradients over tp (ZeRO: their dp
    shards, in ``parallel.reduce_dtype``).

Expert parallelism (``parallel.ep > 1``): every block's experts are sharded over ep before the
split (``parallel.expert.stages.StageExperts``: ep groups carved out of each stage's batch group dp x cp, so the ranks
of one ep group hold the same stage and walk the same action list; their all-to-alls meet in F, in B,
and in W where W is the whole backward of model stage 0; the expert weight gradients of a W are local
matmuls). DDP leaves the expert shards out of its buckets and sums their flat gradient buffer over
the replica group dp/ep in ``finish_grads``; ZeRO shards their flat buffers over that group
(``ZeroSync``'s ``group_of``); the norm sums the expert shards' squares over ep; the canonical state
gathers them over ep. The auxiliary losses need no path across stages: each MoE layer injects its
own into its output's backward, weighted per micro-batch (``models.moe``).

Also: ``last_step_timing()`` (measured busy/idle per rank), ``full_params()`` (the dense model with
every stage's weights broadcast in; collective over pp -- and over tp, which yields a separate
dense model rebuilt from the gathered shards), ``pipeline.generate.pipeline_generate`` (greedy decoding).
"""
from __future__ import annotations

from zerotron.distributed import comm
from zerotron.models.deferred import finish, is_deferred, release_params
from zerotron.models.layout import get_module
from zerotron.parallel.base import Strategy, unique_params
from zerotron.parallel.data.ddp import DataParallel
from zerotron.parallel.data.hsdp import ddp_hierarchy
from zerotron.parallel.data.zero import ZeroSync
from zerotron.parallel.expert.stages import StageExperts
from zerotron.parallel.optim import decay_mask
from zerotron.parallel.pipeline.balance import announce_split, resolve_split
from zerotron.parallel.pipeline.executor import (
    PipelineExecutor,
    StageModel,
    stage_layer_counts,
    stage_layer_ranges,
)
from zerotron.parallel.pipeline.flushes import PipelineFlushMixin
from zerotron.parallel.pipeline.grads import PipelineGradsMixin
from zerotron.parallel.pipeline.stage_sync import StageFSDP2, StageTorchDDP
from zerotron.parallel.pipeline.state import PipelineStateMixin

__all__ = ["PipelineStrategy", "StageModel", "stage_layer_counts",
           "stage_layer_ranges"]


class PipelineStrategy(PipelineFlushMixin, PipelineGradsMixin, PipelineStateMixin, Strategy):
    """Pipeline (x data) parallel strategy; see the module docstring.

    Args: ``model`` (a fully initialised ``CausalLM``, identical on all ranks, or the tensor-parallel
    model made from it; afterwards use ``.module``; with pp > 1 the parameters of other ranks' stages
    are left without memory (``models.deferred.release_params``: meta tensors, identity, shape and
    dtype kept; ``released_bytes``; ``full_params`` gives them memory for the duration of its
    context), so parameter memory falls with pp), ``mesh``, ``plan`` (a
    ``zerotron.plan.ParallelPlan``, already validated: pp_schedule, microbatches, virtual_stages,
    pp_split, bucket_mb, zero_stage, reduce_dtype, dtype, activation_checkpointing),
    ``mask`` (weight-decay flag by ``id(param)`` of ``model``; default ``optim.decay_mask(model)``,
    only used by ZeRO-1, which fixes the flag per flat buffer at construction).
    Attributes: ``module`` (this rank's ``StageModel``), ``ddp`` (inner DataParallel over dp, or
    None with ZeRO-1), ``zero`` (the ZeRO driver ``data.zero.ZeroSync`` over this rank's stages, or None), ``tp_group`` (the tp NamedGroup when
    ``model`` is tensor-parallel, else None), ``loss_groups`` = [pp group, batch group] (``dp_group`` is the batch group dp x cp: under context
    parallelism each stage's gradients are summed, and ZeRO/FSDP2 shard, over it). Raises
    ValueError for a pp_split the model cannot take or a layout with more than one tied pair (the
    rest of the layout rules are the plan's)."""

    def __init__(self, model, mesh, plan, mask: dict | None = None):
        p = self.plan = plan
        self.kind, self.microbatches = p.pp_schedule, p.microbatches
        self.placement = place = p.placement  # which rank holds which model stage (loop, or zb-v's V)
        self.v = place.v  # model stages per rank: virtual_stages when chunked
        self.mesh, self.pp, self.rank = mesh, mesh.size("pp"), mesh.local_rank("pp")
        n_stages = place.n_stages
        recompute = p.activation_checkpointing
        self.split = resolve_split(model, n_stages, p.pp_split, recompute, place)  # layers per model stage
        ranges = stage_layer_ranges(self.split)
        if mesh.rank == 0 and p.pp_split.strip() == "auto":
            announce_split(model, self.split, p.pp_split, recompute, place)
        self.experts, before = None, dict(model.named_parameters())
        if p.ep > 1:  # every block's experts sharded over ep before the split (parallel.expert.stages)
            self.experts = StageExperts(model, mesh.group("batch"), p.ep, mesh.dims.group_ranks("batch"))
        self.dense = model
        self._dense_copy = None  # dense model rebuilt by full_params() for tensor-parallel models
        self.module = StageModel(model, place.stages(self.rank), ranges)
        if is_deferred(model):  # meta-device model: storage and dense values for this rank's stages only
            own = {id(q) for q in self.module.parameters()}
            release_params([q for q in model.parameters() if id(q) not in own])  # they stay on meta
            if p.sync not in ("zero", "fsdp2"):  # ZeRO and FSDP2 materialise unit by unit (parallelize finishes)
                finish(model)
        self.last_rank = place.last_rank  # pp index of the last model stage
        self.tp_group = self.module.tp_group
        self._peer = lambda q: mesh.peer(pp=q)  # pp index -> global rank (same dp, cp, tp)
        self._schedules: dict = {}
        # the batch group dp x cp (= dp without context parallelism): every rank of a stage holding a
        # different part of the global batch's tokens; gradients are summed, ZeRO/FSDP shard, over it
        self.pp_group, self.dp_group = mesh.group("pp"), mesh.group("batch")
        self.loss_groups = [self.pp_group, self.dp_group]
        self.first, self.last = self.module.holds(0), self.module.holds(n_stages - 1)
        expert_ids = self.experts.keep(self.module) if self.experts is not None else frozenset()
        lay = model.layout()
        if len(lay.tied) > 1:
            raise ValueError(f"pipeline parallelism supports at most one tied parameter pair, the layout has "
                             f"{len(lay.tied)}: {list(lay.tied)}")
        self.tied = None  # the parameter shared by stage 0 and the last stage (e.g. tied embedding/head)
        if lay.tied and (self.first or self.last):
            owner = lay.tied[0][1].rpartition(".")
            self.tied = getattr(get_module(self.module, owner[0]), owner[2])
        self.tied_group = None
        if self.last_rank != 0 and lay.tied:  # one {pp-first, pp-last} group per pipeline, made everywhere
            lines = mesh.dims.group_ranks("pp")  # the ranks of one pipeline, by stage
            if len(lines[0]) == 2:  # two pp ranks: the pp group is that pair (no new group, no more gloo threads)
                if self.first or self.last:
                    self.tied_group = comm.NamedGroup(self.pp_group.pg, "pp_tied")
            else:
                for line in lines:
                    pg = comm.new_group([line[0], line[self.last_rank]])
                    if mesh.rank in line and (self.first or self.last):
                        self.tied_group = comm.NamedGroup(pg, "pp_tied")
        self.ddp = self.zero = self.stage_sync = self.fsdp2 = None
        if p.sync == "torch_ddp":  # torch's wrappers per stage chunk (pipeline.stage_sync)
            self.stage_sync = StageTorchDDP(self.module, self.dp_group, p.bucket_mb, p.find_unused_parameters)
        elif p.sync == "fsdp2":  # fully_shard per block and one root per rank (pipeline.stage_sync)
            self.stage_sync = self.fsdp2 = StageFSDP2(self.module, mesh, p.zero_stage, p.dtype, p.reduce_dtype,
                                                          offload=p.offload == "params")
            if self.tied is not None:  # fully_shard registered a new (DTensor) parameter
                self.tied = getattr(get_module(self.module, owner[0]), owner[2])
        elif p.zero_stage:
            mask = mask if mask is not None else decay_mask(model)
            if self.experts is not None:  # the expert shards are new Parameters: the dense ones' flags
                mask = self.experts.decay_flags(mask, before)
            self.zero = self._zero_sync(mesh, mask)
        else:
            self.ddp = DataParallel(self.module, self.dp_group, bucket_mb=p.bucket_mb, src_rank=mesh.peer(dp=0, cp=0),
                                    exclude=expert_ids, **ddp_hierarchy(mesh))  # HSDP: hierarchical all-reduce per bucket
            if self.experts is not None:  # one flat gradient buffer, summed over the replicas in finish_grads
                self.experts.attach_grads()
        self.inner = next(x for x in (self.zero, self.stage_sync, self.ddp) if x is not None)  # no_sync / zero_grad
        act_dtype = getattr(self.stage_sync, "act_dtype", None) or next(iter(self.module.parameters())).dtype
        self.executor = PipelineExecutor(self.module, self.pp_group, place, self.rank, self._peer, act_dtype)
        if self.stage_sync is not None:
            self.executor.forward_chunk = self.stage_sync.forward
        self._timing = {"busy_s": 0.0, "idle_s": 0.0, "bubble_fraction": 0.0}
        own = {id(q) for q in self.module.parameters()}  # other stages' parameters: no memory (meta)
        self._foreign = [q for q in model.parameters() if id(q) not in own] if self.pp > 1 else []
        self.released_bytes = release_params(self._foreign)

    def _zero_sync(self, mesh, mask: dict) -> ZeroSync:
        """The native ZeRO driver over this rank's stages, as the plain runner's over the whole
        model (same shard / replicate groups, HSDP included). Units: the tied weight alone (so the
        first and the last stage hold it in flat buffers of the same layout and reduce it with the
        same arithmetic: the copies stay bitwise equal), the other non-block parameters, then each
        block; ``self._chunk_units[c]``: the units a backward of chunk c produces gradients for."""
        names = {}
        for n, q in self.module.named_parameters():  # first FQN of each (tied) parameter
            names.setdefault(id(q), n)
        blocks = list(self.module.blocks_here.items())  # (global block index, module), chunk by chunk
        in_block = {id(q) for _, b in blocks for q in b.parameters()}
        root = [q for q in unique_params(self.module) if id(q) not in in_block and q is not self.tied]
        roots = ([[self.tied]] if self.tied is not None else []) + [root]
        units = roots + [unique_params(b) for _, b in blocks]
        ends = (0, self.module.last_stage)  # stages that run root modules (embedding, head)
        self._chunk_units = [
            [u for u, (i, _) in enumerate(blocks, start=len(roots)) if int(i) in self.module.layer_ranges[s]]
            + (list(range(len(roots))) if s in ends else []) for s in self.module.stages]
        mask = dict(mask)
        if self.tied is not None:
            mask[id(self.tied)] = False  # an embedding: never decayed
        p, sp = self.plan, self.module.sequence_parallel
        group_of = ({id(q): self.experts.rep_group for q in self.experts.expert_params.values()}
                    if self.experts is not None else None)  # expert shards: sharded over dp/ep
        return ZeroSync(units, names, mask, mesh.group("shard"), p.zero_stage, p.dtype, p.reduce_dtype,
                        n_root=len(roots), blocks=[b for _, b in blocks], tp_group=self.tp_group,
                        sequence_parallel=sp, replicate_group=mesh.group("dp_rep"), dp_group=self.dp_group,
                        tied=self.tied, tied_group=self.tied_group, count_tied=self.first or not self.last,
                        eager=False, offload=p.offload, offload_dir=p.offload_dir, group_of=group_of)

    # ---- structure ---------------------------------------------------------------------------
    def stage_modules(self) -> dict[int, list[str]]:
        """{model stage: names of the modules it runs} for this rank's stages: the layout's embedding
        modules (stage 0), blocks ``<blocks>.<i>`` (global index), head modules (last stage)."""
        lay, out = self.module.layout(), {}
        for s in self.module.stages:
            names = list(lay.embedding) if s == 0 else []
            names += [f"{lay.blocks}.{i}" for i in self.module.layer_ranges[s]]
            if s == self.module.last_stage:
                names += list(lay.head)
            out[s] = names
        return out
