"""Parallelism transforms. ``parallelize(model, cfg, mesh)`` applies them in one fixed order:

    1. tensor / sequence parallel (tp): apply_tensor_parallel on the dense, seeded model
    2. activation checkpointing (train.activation_checkpointing: none | selective | full)
    3. pipeline split (parallel.pp) of the (TP) model (or, with parallel.pp_impl = threads, every
       stage in this process on its own worker thread), or
    4. data parallel over "dp": native bucketed DDP, torch DDP, native ZeRO-1/2/3 or FSDP2 (with
       ``parallel.dp_replicate > 1``, HSDP: ``parallel.data.hsdp``)

The returned *strategy* (``parallel.base.Strategy``) is what the trainer drives: forward_backward
over micro-batches, finish_grads, clip_grad_norm, build_optimizer/optimizer_step, reduce_loss,
model_state_bytes.
"""
from __future__ import annotations

from zerotron.parallel.base import Strategy, autocast_ctx, token_loss_sum, unique_params
from zerotron.parallel.data.ddp import DataParallel, TorchDDP
from zerotron.parallel.data.fsdp import FSDP2Strategy
from zerotron.parallel.data.zero import ZeroStrategy
from zerotron.parallel.dtensor_tp import DTensorTPStrategy
from zerotron.parallel.optim import decay_mask_by_name
from zerotron.parallel.pipeline.runner import PipelineStrategy
from zerotron.parallel.pipeline.threads import ThreadedPipeline
from zerotron.parallel.pipeline.torch_backend import TorchPipeline
from zerotron.parallel.recompute import apply_activation_checkpointing
from zerotron.parallel.tensor.transform import apply_tensor_parallel


def parallelize(model, cfg, mesh):
    """Wrap ``model`` (already on ``mesh.device``, identically initialised on every rank) for the
    layout in ``cfg.parallel``: tensor parallel on the dense model, then activation checkpointing of
    the (TP) blocks, then the pipeline split or data parallelism (``tp_impl = "dtensor"``: torch's
    DTensor TP alone). Raises ValueError for an unknown ``dp_impl``/``zero_impl``."""
    p = cfg.parallel
    names_mask = decay_mask_by_name(model)  # from the dense model, before any transform
    pipeline = mesh.size("pp") > 1 or p.pp_schedule == "interleaved"
    tp_group = None
    if mesh.size("tp") > 1 and p.tp_impl == "dtensor":  # torch's TP, alone (config.validate)
        strategy = DTensorTPStrategy(model, mesh.mesh["tp"], mesh.group("tp"))
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
        strategy.decay_mask = {id(q): names_mask[n] for n, q in model.named_parameters(remove_duplicate=False)}
        return strategy
    if mesh.size("tp") > 1:
        tp_group = mesh.group("tp")
        model = apply_tensor_parallel(model, tp_group, p.sequence_parallel, seed=cfg.train.seed,
                                      dp_rank=mesh.coords["dp"], pp_rank=mesh.coords["pp"])
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)  # block forwards only
    mask = {id(q): names_mask[n] for n, q in model.named_parameters(remove_duplicate=False)}
    if p.pp_impl == "threads":  # one process, a worker thread per stage (config: dp only)
        strategy = ThreadedPipeline(model, mesh, cfg)
    elif p.pp_impl == "torch":  # torch.distributed.pipelining schedules on the native split (config: pp x DDP)
        strategy = TorchPipeline(model, mesh, cfg, mask)
    elif pipeline:  # (x tp x dp / ZeRO-1): stage split of the (TP) model; see parallel.pipeline
        strategy = PipelineStrategy(model, mesh, cfg, mask)
    else:
        strategy = _data_parallel(model, cfg, mesh, mask)
    strategy.tp_group = tp_group
    # by name again: FSDP2 replaces parameters with DTensor parameters (new objects)
    strategy.decay_mask = {**mask, **{id(q): names_mask[n] for n, q in strategy.module.named_parameters(remove_duplicate=False)}}
    return strategy


def _data_parallel(model, cfg, mesh, mask):
    p = cfg.parallel
    group = mesh.group("dp")
    src = mesh.global_rank(mesh.coords["pp"], 0, mesh.coords["tp"])
    if p.zero_stage:
        if p.zero_impl == "native":  # HSDP: shard within dp_shard, all-reduce shards over dp_rep
            return ZeroStrategy(model, mesh.group("dp_shard"), p.zero_stage, cfg.train.dtype, p.reduce_dtype, mask,
                                tp_group=mesh.group("tp") if mesh.size("tp") > 1 else None,
                                sequence_parallel=p.sequence_parallel, replicate_group=mesh.group("dp_rep"),
                                dp_group=group)
        if p.zero_impl == "fsdp2":
            return FSDP2Strategy(model, mesh, p.zero_stage, cfg.train.dtype, p.reduce_dtype)
        raise ValueError(f"parallel.zero_impl must be 'native' or 'fsdp2', got {p.zero_impl!r}")
    if p.dp_impl == "native":
        return DataParallel(model, group, bucket_mb=p.bucket_mb, src_rank=src,
                            shard_group=mesh.group("dp_shard") if mesh.group("dp_rep") else None,
                            replicate_group=mesh.group("dp_rep"))
    if p.dp_impl == "torch":
        return TorchDDP(model, group, bucket_mb=p.bucket_mb, find_unused_parameters=p.find_unused_parameters)
    raise ValueError(f"parallel.dp_impl must be 'native' or 'torch', got {p.dp_impl!r}")


__all__ = ["parallelize", "Strategy", "DataParallel", "TorchDDP", "unique_params", "autocast_ctx", "token_loss_sum"]
