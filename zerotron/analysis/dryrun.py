"""Dry runs at cluster scale: one training step of one rank of a large layout, traced in this
process with fake tensors and the fake process group (issue 33).

For a config and a world size (up to thousands of ranks) :func:`dry_run` runs, for each traced
rank, the *real* zerotron code of a training step -- ``parallelize`` (tensor parallel, activation
checkpointing, the pipeline runner, the gradient synchroniser), forward and backward over the
rank's micro-batches, ``finish_grads``, the grad-norm clip, the optimizer step -- with

* ``torch._subclasses.FakeTensorMode``: tensors with shapes, dtypes and storages of the right size
  but no memory, so a 70B model costs the process a few hundred MB;
* torch's ``fake`` process-group backend (``torch.testing._internal.distributed.fake_pg``): the
  default group is created with ``rank = R`` and ``world_size = N``, so the DeviceMesh, every
  zerotron group and every collective are those of rank R; collectives return at once and move no
  data, but go through ``zerotron.distributed.comm``, which counts them (``comm.STATS``);
* a ``torch.distributed._tools.MemTracker`` (a dispatch mode counting the bytes of every live
  storage by category: parameters, gradients, optimizer state, activations, temporaries of the
  backward, other) whose peak is the step's peak memory, with the moment it happened (step phase,
  innermost module, forward or backward).

Values read back from fake tensors (``.item()``: the loss, the grad norm, token counts) are 1: the
dry run traces shapes and traffic, not numerics. The token ids are synthetic (uniform over the
preset's vocabulary, no corpus or tokenizer). Two steps run: the first creates the optimizer state
(lazily, as AdamW does), the second is the one measured (memory and traffic of a steady step).

Beside each traced figure the record holds the estimators' figure for the same rank and layout:
model states (:func:`zerotron.analysis.memory.model_state_bytes` on
:func:`~zerotron.analysis.memory.stage_num_params`) + activations
(:func:`zerotron.analysis.activations.activation_bytes`), and the collective bytes the planner
prices (:func:`zerotron.analysis.comm_messages.comm_bytes`), per group.

The dry run imports ``parallel`` (the code it traces) but not ``train`` (``train`` imports
``analysis``); its step (``dryrun_trace.traced_step``) is ``train.step.train_step`` without the LR
scheduler and the non-finite guard, the same strategy calls in the same order.

Its parts: :mod:`~zerotron.analysis.dryrun_rank` (the rank's model, strategy, optimizer and
synthetic batches), :mod:`~zerotron.analysis.dryrun_trace` (one traced rank: fake backend, fake
tensors, two steps), :mod:`~zerotron.analysis.dryrun_memory` (the tracker and the categories),
:mod:`~zerotron.analysis.dryrun_comm` (the fake backend's works and code paths, traffic per group),
:mod:`~zerotron.analysis.dryrun_estimate` (the estimators' figure for a traced rank); this module:
the entry point :func:`dry_run`, the planner's bytes (:func:`planned_comm`) and the step time
(:func:`predict_step_time`).
"""
from __future__ import annotations

import resource

from zerotron.analysis.activations import looped_counts, stage_layer_counts
from zerotron.analysis.dryrun_estimate import estimate, layout_of
from zerotron.analysis.dryrun_memory import CATEGORIES
from zerotron.analysis.dryrun_rank import (
    DryRunError,
    build_rank,
    default_ranks,
    model_config,
    rank_batches,
    synthetic_batches,
)
from zerotron.analysis.dryrun_trace import trace_rank
from zerotron.analysis.flops import shape_of
from zerotron.analysis.trace_time import group_scopes, rank_time, step_time
from zerotron.config import ConfigError
from zerotron.config_sections import Config

__all__ = ["DryRunError", "default_ranks", "dry_run", "predict_step_time", "estimate", "build_rank", "rank_batches",
           "synthetic_batches", "model_config", "planned_comm", "CATEGORIES"]


def planned_comm(cfg: Config, plan, pp_rank: int, layer_counts: list[int] | None = None, with_calls: bool = False):
    """Bytes per group of one step the planner prices for pipeline rank ``pp_rank``
    (:func:`zerotron.analysis.comm_messages.comm_bytes`): the training dtype's element size, gradient
    reductions in ``parallel.reduce_dtype``'s (``parallel.precision.reduce_dtype``), ``layer_counts``
    the runner's layers per model stage (a record's ``layer_counts``; None: the even split). With
    ``with_calls``: ``(bytes, calls)``, calls per group of the ZeRO / FSDP2 collectives."""
    from zerotron.analysis.comm_messages import comm_bytes
    from zerotron.parallel.precision import reduce_dtype

    mcfg = model_config(cfg)
    lay = layout_of(cfg, plan, mcfg)
    elem = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    layout = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero_stage": lay.zero_stage, "micro_batch": lay.micro_batch,
              "schedule": lay.schedule if lay.pp > 1 else "none", "recompute": lay.recompute,
              "dp_replicate": lay.dp_replicate, "cp": plan.dims.cp, "zero_impl": cfg.parallel.zero_impl}
    red = reduce_dtype(cfg.train.dtype, cfg.parallel.reduce_dtype).itemsize
    out, calls = comm_bytes(shape_of(mcfg), layout, lay.seq, cfg.train.global_batch, pp_rank, elem_bytes=elem,
                            sp=lay.sp, bucket_bytes=int(cfg.parallel.bucket_mb * 2**20), reduce_bytes=red,
                            layer_counts=layer_counts, with_calls=True)
    if plan.dims.cp > 1 and cfg.parallel.cp_impl != "ring":  # the planner prices ring attention's messages only
        out.pop("cp", None)
    return (out, calls) if with_calls else out


def predict_step_time(cfg: Config, plan, records: list[dict], hw, gpus_per_node: int = 8,
                      compute_eff: float = 0.5, launch_s: float = 20e-6) -> dict:
    """The step time of ``cfg``'s layout on ``hw`` (a :class:`~zerotron.analysis.hardware.Hardware`)
    predicted from the traced ``records`` (:mod:`zerotron.analysis.trace_time`) and by the
    planner's formula (:func:`zerotron.analysis.layout_cost.evaluate`, same hardware, ``compute_eff``,
    ``gpus_per_node``, ``launch_s``; None under context parallelism with cp_impl a2a or
    allgather: the planner prices ring attention only). Adds to each record ``time_traced_s`` (its :func:`~zerotron.analysis.trace_time.rank_time`)
    ``group_scopes`` (:func:`~zerotron.analysis.trace_time.group_scopes` of its ``group_members`` on
    nodes of ``gpus_per_node`` ranks) and ``flops_formula`` (the planner's matmul + attention FLOPs of that rank's m micro-batches,
    :func:`zerotron.analysis.flops.m_flops`, / cp under context parallelism). Returns ``{"hardware", "trace":
    step_time's dict, "formula": {"step_s", "breakdown_s"} or None, "ratio": trace / formula}``."""
    from zerotron.analysis.cost_model import CostModel
    from zerotron.analysis.flops import m_flops, recompute_flops
    from zerotron.analysis.layout_cost import evaluate

    mcfg = model_config(cfg)
    lay = layout_of(cfg, plan, mcfg)
    shape = shape_of(mcfg)
    cp = plan.dims.cp
    m = cfg.train.global_batch // (plan.dims.size("dp") * cfg.train.micro_batch)
    split = [r["layer_counts"] for r in records if r["layer_counts"]]
    counts = looped_counts(split[0] if split else stage_layer_counts(shape.n_layer, lay.pp * lay.virtual_stages),
                           lay.pp, lay.schedule)
    layers = [sum(counts[c * lay.pp + r] for c in range(lay.virtual_stages)) for r in range(lay.pp)]
    parts = {}
    for rec in records:
        rec["group_scopes"] = group_scopes(rec["group_members"], rec["comm_traced"], gpus_per_node)
        rec["time_traced_s"] = rank_time(rec["counts_traced"], rec["comm_traced"], rec["group_scopes"], hw,
                                         compute_eff)
        pp_rank = rec["coords"]["pp"]
        parts.setdefault(pp_rank, rec["time_traced_s"])
        rec["flops_formula"] = m * m_flops(shape, lay.micro_batch, lay.seq, layers[pp_rank], pp_rank == lay.pp - 1,
                                           lay.tp, lay.recompute) / cp  # each rank: S/cp queries against S keys
    h, W, S = shape.n_embd, shape.block_matmul_params(), lay.seq
    cost_split = (2 * W + 4 * h * S, 2 * W + 8 * h * S + recompute_flops(shape, S, lay.recompute), 2 * W)
    trace = step_time(parts, layers, m, lay.schedule if lay.pp > 1 else "none", lay.virtual_stages, cost_split,
                      hw, launch_s)
    formula = None
    if cp == 1 or cfg.parallel.cp_impl == "ring":  # the planner prices ring attention only
        elem = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
        cm = CostModel(hw, gpus_per_node=gpus_per_node, compute_eff=compute_eff, overhead=0, sp=lay.sp,
                       launch_s=launch_s, elem_bytes=elem, bucket_bytes=int(cfg.parallel.bucket_mb * 2**20))
        layout = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero_stage": lay.zero_stage,
                  "schedule": lay.schedule if lay.pp > 1 else "none", "micro_batch": lay.micro_batch,
                  "recompute": lay.recompute, "dp_replicate": lay.dp_replicate, "cp": cp,
                  "zero_impl": cfg.parallel.zero_impl}
        ev = evaluate(shape, layout, S, cfg.train.global_batch, cm)
        formula = {"step_s": ev["predicted_step_time_s"], "breakdown_s": ev["time_breakdown_s"]}
    return {"hardware": hw.name, "gpus_per_node": gpus_per_node, "compute_eff": compute_eff, "trace": trace,
            "formula": formula, "ratio": _ratio(trace["step_s"], formula["step_s"]) if formula else None}


# ---- the entry point -----------------------------------------------------------------------------

def _ratio(a, b):
    return a / b if b else None


def dry_run(cfg: Config, world: int, ranks: list[int] | None = None, gpu_mem: int | None = None,
            hw=None, gpus_per_node: int = 8, compute_eff: float = 0.5, launch_s: float = 20e-6) -> list[dict]:
    """Trace one training step of each of ``ranks`` (default :func:`default_ranks`) of ``cfg``'s
    layout on ``world`` ranks, in this process (module docstring). ``gpu_mem``: capacity in bytes
    for the out-of-memory report. Returns one record per rank: ``rank``, ``coords`` (axes and
    combined groups), ``peak_bytes_traced`` and ``peak_traced`` (bytes per :data:`CATEGORIES` at
    the peak of the measured step), ``peak_at`` (phase, module, pass), ``setup_peak_bytes`` (the
    traced model build and ``parallelize``: dense, as fake tensors cannot be built deferred, see
    ``models.deferred``), ``meta_init`` (``train.meta_init``) and ``construction_bytes`` (what a
    real rank's meta-device construction peaks at: what it holds after ``parallelize`` + the
    largest dense tensor), ``model_state_bytes`` (the strategy's own count after the
    step), ``peak_bytes_estimated`` and ``estimated`` (:func:`estimate`), ``comm_bytes_traced`` /
    ``comm_bytes_planned`` ({group: bytes} of the measured step; the planner's where it prices the
    group), ``comm_calls_planned`` ({group: calls} of the planner's ZeRO / FSDP2 collectives),
    ``comm_traced`` (per group: bytes, calls, bytes per op/tag), ratios traced/estimated,
    ``oom`` (None, or the first moment the total exceeded ``gpu_mem``: phase, module, pass, the
    category that grew, bytes; phase "model states" with the largest category when the states
    held before the step already exceed it; phase "setup" when the model build
    (``construction_bytes`` with ``train.meta_init``, else the dense build's peak) already does, and then
    ``oom_step`` says what the step would do), ``wall_s`` and ``max_rss_bytes`` (of this process so far);
    ``counts_traced`` (FLOPs, element passes, ops of the measured step:
    :class:`~zerotron.analysis.trace_time.StepCounter`), ``flops_traced`` beside ``flops_formula``,
    ``group_members`` (global ranks per traced group), ``group_scopes`` (size, intra-node per
    traced group on nodes of ``gpus_per_node`` ranks),
    ``time_traced_s`` and ``step_time`` (:func:`predict_step_time` on ``hw``, default the
    datasheet H100 preset, at ``compute_eff``, ``launch_s`` seconds per layer and micro-batch; the
    same dict in every record).
    A world-size-1 default process group of the caller (e.g. a test's) is replaced by the fake one
    during the trace and re-created afterwards (same backend); one of more ranks is refused.
    Raises DryRunError for a config the plan refuses on ``world`` ranks, a rank outside it, or a
    caller inside a multi-rank job."""
    from zerotron.plan import build_plan

    try:
        plan = build_plan(cfg, world)
    except ConfigError as e:  # the plan speaks of the training launcher's --nproc; here it is --world
        msg = str(e).replace("--nproc", "--world")
        raise DryRunError(msg if f"world size {world}" in msg else f"{msg} (world size {world})") from None
    if plan.runner not in ("plain", "pipeline"):
        raise DryRunError(f"parallel.pp_impl = {cfg.parallel.pp_impl!r} cannot be dry-run (it runs its stages in "
                          "threads or through torch.distributed.pipelining); use the native pipeline")
    if plan.shape and plan.shape.get("n_experts"):
        raise DryRunError("mixture-of-experts models cannot be dry-run yet (the router's per-expert token counts are "
                          "data-dependent shapes, which fake tensors do not have); dry-run a dense model")
    if cfg.parallel.dp_impl == "torch" and plan.dims.size("dp") > 1:
        raise DryRunError("parallel.dp_impl = 'torch' cannot be dry-run (torch DDP checks the parameters' data "
                          "across ranks at construction; fake tensors have none); use dp_impl = 'native'")
    ranks = default_ranks(plan.dims) if ranks is None else list(ranks)
    for r in ranks:
        if not 0 <= r < world:
            raise DryRunError(f"--rank {r} is not a rank of world size {world}; choose 0..{world - 1}")
    import torch.distributed as dist

    held = dist.get_backend() if dist.is_initialized() else None  # the caller's default group
    if held is not None and dist.get_world_size() > 1:
        raise DryRunError("a dry run replaces this process's default process group with a fake one; run it in a "
                          f"process of its own, not inside a {dist.get_world_size()}-rank job")
    out = []
    try:
        for r in ranks:
            out.append(trace_rank(cfg, plan, r, gpu_mem))
    finally:
        if held is not None and not dist.is_initialized():  # give a world-1 caller its group back
            from zerotron.distributed.mesh import init_distributed

            init_distributed(held)
    for rec in out:
        pp_rank = rec["coords"]["pp"]
        est = estimate(cfg, plan, pp_rank, rec["layer_counts"], rec["coords"].get("tp", 0))
        planned, planned_calls = planned_comm(cfg, plan, pp_rank, rec["layer_counts"], with_calls=True)
        rec.update(peak_bytes_estimated=est["total"], estimated=est, comm_bytes_planned=planned,
                   comm_calls_planned=planned_calls,
                   ratios={"peak": _ratio(rec["peak_bytes_traced"], est["total"]),
                           "model_states": _ratio(rec["model_state_bytes"]["total_bytes"],
                                                  est["model_states"]["total_bytes"]),
                           "comm": {g: _ratio(rec["comm_bytes_traced"].get(g, 0), b) for g, b in planned.items()}},
                   max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   world=world, gpu_mem=gpu_mem)
        rec["oom_step"] = rec["oom"]
        build = rec["construction_bytes"] if rec["meta_init"] else rec["setup_peak_bytes"]
        if gpu_mem is not None and build > gpu_mem:  # the first moment: the model's build
            rec["oom"] = {"phase": "setup", "module": None, "pass": None, "category": "parameters",
                          "total_bytes": build}
    if hw is None:
        from zerotron.analysis.hardware import hardware
        hw = hardware("h100")
    step = predict_step_time(cfg, plan, out, hw, gpus_per_node, compute_eff, launch_s)
    for rec in out:
        rec["step_time"] = step
        rec["ratios"]["flops"] = _ratio(rec["flops_traced"], rec["flops_formula"]) if rec["flops_formula"] else None
    return out
