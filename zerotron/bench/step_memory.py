"""The measured memory of a real training step on one rank, to hold a dry run against (issue 33).

:func:`measure_step_memory` runs in every rank of a real job (gloo, real tensors) what a dry run
traces with fake ones (``analysis.dryrun``): the rank built as the trainer builds it
(``dryrun.build_rank``), the synthetic micro-batches of ``dryrun.synthetic_batches``, and two
``train.step.train_step`` calls (the first creates AdamW's state; the second is measured). The
count is the CPU allocator's, not a tracker's: under ``torch.profiler.profile(profile_memory=True)``
the allocator reports every allocation and free with its size (``_ExtraFields_Allocation.alloc_size``),
so the bytes live at any moment are the running sum from the start of the window (opened before the
model is built, so everything the rank allocates is inside it). No ``MemTracker``, no dispatch mode,
no module hooks: nothing the dry run adds is present here.

What this counts that a dry run's ``MemTracker`` does not: allocations the allocator makes for
tensors that are not the output of an operator (gloo's receive buffers are its own, not counted
either way); what it does not count: allocations on threads the profiler does not follow (none in
the step's own code; the pipeline's gloo sends and receives post from this thread).
"""
from __future__ import annotations

import torch

__all__ = ["measure_step_memory"]

_STEP = "zerotron.measured_step"


def _allocations(prof) -> list[tuple[int, int]]:
    """``[(time_ns, bytes), ...]`` of every allocation (+) and free (-) the profiler saw, in time order."""
    from torch._C._profiler import _EventType

    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        n = todo.pop()
        todo.extend(n.children)
        if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
            out.append((n.start_time_ns, n.extra_fields.alloc_size))
    return sorted(out)


def _window(prof, name: str) -> tuple[int, int]:
    """(start, end) ns of the profiled ``record_function(name)``."""
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        n = todo.pop()
        if n.name == name:
            return n.start_time_ns, n.end_time_ns
        todo.extend(n.children)
    raise RuntimeError(f"the profiler recorded no {name!r} region")


def measure_step_memory(cfg, steps: int = 2) -> dict:
    """On this rank of a real job (the default process group initialised, of the world size the
    layout needs): build the rank, run ``steps`` training steps on the dry run's synthetic batches
    and return the allocator's figures of the last one, in bytes: ``{"rank", "coords" (mesh
    coordinates), "held_at_step_start" (live before the step), "peak_bytes_measured" (the most live
    at once during the step), "end_of_step" (live after it), "model_state_bytes" (the strategy's own
    count), "loss"}``. Raises what building or training the layout raises."""
    import gc

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from zerotron.analysis.dryrun import build_rank, rank_batches
    from zerotron.distributed.mesh import Mesh
    from zerotron.plan import build_plan
    from zerotron.train.optim import build_scheduler
    from zerotron.train.step import train_step

    gc.collect()  # a pooled rank's earlier objects are not freed inside the window
    plan = build_plan(cfg, dist.get_world_size())
    mesh = Mesh(plan.dims, torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mcfg, strategy, optimizer = build_rank(cfg, plan, mesh)
        sched = build_scheduler(optimizer, cfg.train)
        batches = rank_batches(cfg, mesh, mcfg)
        for i in range(steps):
            with record_function(_STEP if i == steps - 1 else f"{_STEP}.warm"):
                out = train_step(strategy, optimizer, sched, batches, mesh.group("batch"), cfg.train.grad_clip,
                                 cfg.train.dtype)
    start, end = _window(prof, _STEP)
    live = before = peak = after = 0
    for t, b in _allocations(prof):
        live += b
        if t < start:
            before = peak = after = live
        elif t <= end:
            peak, after = max(peak, live), live
    states = strategy.model_state_bytes(optimizer)
    return {"rank": dist.get_rank(), "coords": dict(mesh.coords), "held_at_step_start": before,
            "peak_bytes_measured": peak, "end_of_step": after, "model_state_bytes": states, "loss": out["loss"]}
