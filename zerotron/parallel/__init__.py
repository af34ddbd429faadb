"""Parallelism transforms. ``parallelize(model, plan, mesh)`` applies them in one fixed order:

    1. tensor / sequence parallel (tp): apply_tensor_parallel on the dense, seeded model, then
       context parallel (cp, outside tp): apply_context_parallel installs the cp positions and attention
    2. activation checkpointing (train.activation_checkpointing: none | selective | full), then
       regional compilation of each block's forward (train.compile; ``parallel.compile``)
    3. the runner (``plan.runner``): the pipeline split (parallel.pp) of the (TP) model, run by the
       native executor, torch.distributed.pipelining (pp_impl = torch) or one worker thread per stage
       in this process (pp_impl = threads); or "plain", the whole model per step
    4. composed with the gradient synchroniser (``plan.sync``) over the batch group dp x cp: native
       bucketed DDP, torch DDP (all-reduce over it), native ZeRO-1/2/3 or FSDP2 (sharded over
       dp_shard x cp; with ``parallel.dp_replicate > 1``, HSDP: ``parallel.data.hsdp``; with ``parallel.ep > 1``,
       expert parallelism: ``parallel.expert``, experts sharded over ep carved out of dp x cp (dp_shard x cp
       under HSDP) and data parallel over (dp x cp)/ep, under each of the four synchronisers); the pipeline
       runners carry theirs per stage (over dp x cp on the native executor; the threads/torch runners refuse cp)

The returned *strategy* (``parallel.base.Strategy``) is what the trainer drives: forward_backward
over micro-batches, finish_grads, clip_grad_norm, build_optimizer/optimizer_step, reduce_loss,
model_state_bytes.
"""
from __future__ import annotations

from zerotron.models.deferred import adopt, finish, is_deferred
from zerotron.parallel.base import Strategy, autocast_ctx, token_loss_sum, unique_params
from zerotron.parallel.compile import apply_compile
from zerotron.parallel.context.transform import apply_context_parallel
from zerotron.parallel.data.ddp import DataParallel, TorchDDP
from zerotron.parallel.data.fsdp import FSDP2Strategy
from zerotron.parallel.data.hsdp import ddp_hierarchy
from zerotron.parallel.data.zero import ZeroStrategy
from zerotron.parallel.dtensor_tp import DTensorTPStrategy
from zerotron.parallel.expert import ExpertDataParallel, ExpertFSDP2, ExpertTorchDDP, ExpertZero
from zerotron.parallel.optim import decay_mask_by_name
from zerotron.parallel.pipeline.runner import PipelineStrategy
from zerotron.parallel.pipeline.threads import ThreadedPipeline
from zerotron.parallel.recompute import apply_activation_checkpointing
from zerotron.parallel.tensor.layers import local_shard
from zerotron.parallel.tensor.transform import apply_tensor_parallel


def parallelize(model, plan, mesh):
    """Wrap ``model`` (already on ``mesh.device``, identically initialised on every rank) for
    ``plan`` (a validated ``zerotron.plan.ParallelPlan``; its dims are ``mesh``'s): tensor parallel
    on the dense model, then activation checkpointing of the (TP) blocks, then the plan's runner
    (pipeline, threads, torch pipelining) composed with its gradient synchroniser, or the
    synchroniser alone (``plan.sync``: native DDP, torch DDP, native ZeRO-1/2/3, FSDP2; DTensor TP
    alone). Returns the ``Strategy`` the trainer drives.

    A meta-device ``model`` (``zerotron.models.deferred.build_deferred``, ``train.meta_init``) is
    cut on the meta device and given storage and its dense values only where this rank keeps them
    (``models.deferred``: the tensor-parallel slices of the pipeline stages it runs, ZeRO and FSDP2
    one unit at a time; the threads / torch pipelines, DTensor TP and experts take it whole)."""
    names_mask = decay_mask_by_name(model)  # from the dense model, before any transform
    tp_group = None
    deferred = is_deferred(model)
    if deferred and (plan.runner not in ("plain", "pipeline") or plan.sync == "dtensor_tp" or plan.ep > 1):
        finish(model)  # these runners and expert sharding take a dense model
        deferred = False
    dense = dict(model.named_parameters(remove_duplicate=False)) if deferred else {}
    if plan.sync == "dtensor_tp":  # torch's TP, alone (the plan refuses the rest)
        strategy = DTensorTPStrategy(model, mesh.mesh["tp"], mesh.group("tp"))
        apply_activation_checkpointing(model, plan.activation_checkpointing)
        strategy.decay_mask = {id(q): names_mask[n] for n, q in model.named_parameters(remove_duplicate=False)}
        return strategy
    if mesh.size("tp") > 1:
        tp_group = mesh.group("tp")
        model = apply_tensor_parallel(model, tp_group, plan.sequence_parallel, seed=plan.seed,
                                      dp_rank=mesh.coords["batch"], pp_rank=mesh.coords["pp"])
        if deferred:  # each tp layer's (meta) parameter is cut from the dense one of the same name
            for n, q in model.named_parameters(remove_duplicate=False):
                if q is not dense[n]:
                    adopt(q, dense[n])
            model.deferred_init.slice_fn = lambda q, full: local_shard(q, full, tp_group)
    if mesh.size("cp") > 1:  # outside tp: the local chunk's tokens go through the (TP) model unchanged
        apply_context_parallel(model, mesh.group("cp"), plan.cp_impl)
    apply_activation_checkpointing(model, plan.activation_checkpointing)  # block forwards only
    apply_compile(model, plan.compile)  # the (checkpointed) block forwards; hooks stay eager
    mask = {id(q): names_mask[n] for n, q in model.named_parameters(remove_duplicate=False)}
    if deferred and plan.runner == "plain" and plan.sync not in ("zero", "fsdp2"):
        finish(model)  # DDP takes the model whole; ZeRO and FSDP2 materialise unit by unit
    runners = {"threads": lambda: ThreadedPipeline(model, mesh, plan),  # one process, a thread per stage
               "torch": lambda: _torch_pipeline(model, mesh, plan, mask),  # torch.distributed.pipelining
               "pipeline": lambda: PipelineStrategy(model, mesh, plan, mask),  # (x tp x dp / ZeRO-1/2/3)
               "plain": lambda: _data_parallel(model, plan, mesh, mask)}
    strategy = runners[plan.runner]()
    finish(model)  # a deferred model: what no synchroniser took, and the buffers (else nothing)
    strategy.tp_group = tp_group
    # by name again: FSDP2 replaces parameters with DTensor parameters (new objects)
    strategy.decay_mask = {**mask, **{id(q): names_mask[n] for n, q in strategy.module.named_parameters(remove_duplicate=False)}}
    return strategy


def _data_parallel(model, plan, mesh, mask):
    """The plan's gradient synchroniser over the whole model (runner "plain"): gradients are summed
    over the batch group dp x cp (every rank holding a different part of the global batch's tokens),
    sharded over dp_shard x cp ("shard")."""
    group = mesh.group("batch")  # = "dp" without context parallelism
    src = mesh.peer(dp=0, cp=0)  # the first batch-group rank of this rank's (pp, tp) position
    tp = mesh.group("tp") if mesh.size("tp") > 1 else None
    if plan.sync == "zero" and plan.ep > 1:  # ZeRO-1/2/3 x experts sharded over ep (parallel.expert); HSDP:
        # ep carved out of each shard group, the experts' flats sharded over its dp_shard/ep ranks
        return ExpertZero(model, mesh.group("shard"), plan.ep, plan.zero_stage, plan.dtype, plan.reduce_dtype, mask,
                          plan.offload, tp_group=tp, lines=mesh.dims.group_ranks("shard"), offload_dir=plan.offload_dir,
                          replicate_group=mesh.group("dp_rep"), full_dp_group=group,
                          sequence_parallel=plan.sequence_parallel)
    if plan.sync == "zero":  # HSDP: shard within the shard group, all-reduce shards over the replicas
        return ZeroStrategy(model, mesh.group("shard"), plan.zero_stage, plan.dtype, plan.reduce_dtype, mask,
                            tp_group=mesh.group("tp") if mesh.size("tp") > 1 else None,
                            sequence_parallel=plan.sequence_parallel, replicate_group=mesh.group("dp_rep"),
                            dp_group=group, offload=plan.offload, offload_dir=plan.offload_dir)
    if plan.sync == "fsdp2" and plan.ep > 1:  # experts fully_shard-ed over dp/ep (parallel.expert.fsdp)
        return ExpertFSDP2(model, mesh, plan.ep, plan.zero_stage, plan.dtype, plan.reduce_dtype)
    if plan.sync == "fsdp2":
        return FSDP2Strategy(model, mesh, plan.zero_stage, plan.dtype, plan.reduce_dtype, offload=plan.offload == "params")
    if plan.sync == "ddp" and plan.ep > 1:  # experts sharded over ep, summed over dp/ep (parallel.expert)
        return ExpertDataParallel(model, group, plan.ep, bucket_mb=plan.bucket_mb, src_rank=src,
                                  lines=mesh.dims.group_ranks("batch"), **ddp_hierarchy(mesh))
    if plan.sync == "ddp":
        return DataParallel(model, group, bucket_mb=plan.bucket_mb, src_rank=src,
                            **ddp_hierarchy(mesh))
    if plan.ep > 1:  # torch DDP over the non-expert parameters, experts summed over dp/ep (parallel.expert)
        return ExpertTorchDDP(model, group, plan.ep, bucket_mb=plan.bucket_mb,
                              find_unused_parameters=plan.find_unused_parameters, lines=mesh.dims.group_ranks("batch"))
    return TorchDDP(model, group, bucket_mb=plan.bucket_mb, find_unused_parameters=plan.find_unused_parameters)


def _torch_pipeline(model, mesh, plan, mask):
    """The torch.distributed.pipelining runner, imported on first use: that package (with the
    torch._dynamo and DTensor modules it imports) adds ~0.5 s CPU to every process that imports
    this one, and only ``parallel.pp_impl = torch`` needs it."""
    from zerotron.parallel.pipeline.torch_backend import TorchPipeline

    return TorchPipeline(model, mesh, plan, mask)


__all__ = ["parallelize", "Strategy", "DataParallel", "TorchDDP", "unique_params", "autocast_ctx", "token_loss_sum"]
