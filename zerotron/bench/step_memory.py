"""The measured memory of a real training step on one rank, to hold a dry run against (issue 33).

:func:`measure_step_memory` runs in every rank of a real job (gloo, real tensors) what a dry run
traces with fake ones (``analysis.dryrun``): the rank built as the trainer builds it
(``dryrun.build_rank``), the synthetic micro-batches of ``dryrun.rank_batches``, and two
``train.step.train_step`` calls (the first creates AdamW's state; the second is measured). The
count is the CPU allocator's, not a tracker's: under ``torch.profiler.profile(profile_memory=True)``
the allocator reports allocations and frees with their size and address
(``_ExtraFields_Allocation.alloc_size`` / ``.ptr``), so the bytes live at any moment are the running
sum from the start of the window (opened before the model is built, so everything the rank
allocates is inside it). No ``MemTracker``, no dispatch mode, no module hooks.

Two things of a real gloo run the plain running sum gets wrong, both seen in the event records
(``benchmarks/dryrun_vs_real.md``):

* **Frees the profiler does not see.** The allocator reports to the profiler only on a thread whose
  thread-local profiler state is set: the calling thread, and a gloo worker thread only while it
  runs a collective (gloo hands the caller's state to the work). A gloo ``Work`` holds the tensors
  of its collective; the worker drops its reference just *after* the run, when that state is gone.
  If the caller has already dropped its own (a tp all-reduce's result consumed at once, gloo's
  reduce-scatter staging copy, a finished async gather), the last reference -- and the free -- is
  on the worker, unreported, and the running sum keeps the block for ever. Which blocks this hits
  depends on thread timing (0 to 0.9 MB per step here). Such a block is recognised exactly: its
  address is allocated again while it is still "live" in the sum, or no tensor alive after the step
  uses it (a scan of every tensor object). It is counted as freed when the worker's run of the
  next collective posted after it ends (the ``gloo:*`` record that follows its allocation) -- the
  earliest moment the worker can drop it; the real free follows within the worker's next few
  instructions, unless the OS preempts it there (``unseen_frees`` reports their number and bytes).
  ``torch.profiler``'s ``profile_all_threads`` is no way out: with it the allocator reports nothing
  at all (torch 2.13, checked).
* **The backend's own buffers.** gloo stages some collectives through memory of its own: an
  all-gather into a flat copy of the output (allocated on the worker), a reduce-scatter by an
  all-reduce of a clone of the whole input (allocated in the ``c10d::`` call, held by the Work).
  The fake backend of a dry run allocates nothing, nor does NCCL for these calls. Allocations made
  inside a ``c10d::``/``gloo:`` record (any thread) are counted apart (``backend_peak_bytes``),
  not in the figures compared with a dry run.

And one thing of any real run that no dispatch-level tracker can see: **a kernel's workspace**,
memory an operator's kernel takes from the allocator and gives back before the operator returns,
which no tensor ever holds. On this machine's CPU every bf16 ``aten::mm`` does so (oneDNN's
scratch: 67,200-148,608 bytes beside a 16-64 KB output at configs/tiny.toml's shapes; fp32 ``mm``
none; checked with single ``torch.mm`` calls under the profiler), so a real bf16 step peaks inside
a matmul of the backward by that much more than the same step's tensors (ZeRO-3 x bf16 x full
recomputation: +66,680 bytes, 2.2 %, before this was counted apart). A fake tensor runs no kernel,
and the size depends on the kernel library and the CPU, not on the model (on GPUs: cuBLAS's
workspace, allocated once, part of the estimator's framework overhead). An allocation freed before
the innermost ``aten::`` record that encloses it ends, on the same thread, is counted apart
(``workspace_peak_bytes``), not in the figures compared with a dry run.
"""
from __future__ import annotations

import bisect

import torch

__all__ = ["measure_step_memory"]

_STEP = "zerotron.measured_step"
_BACKEND = ("c10d::", "gloo:", "nccl:")
CODE, BACKEND, WORKSPACE = 0, 1, 2  # whose allocation: the code's tensors, the backend's own, a kernel's workspace


def _walk(prof) -> tuple[list, list, tuple]:
    """One pass over every thread's event tree: ``(allocs, gloo_ends, window)`` with ``allocs`` =
    ``[(time_ns, bytes, ptr, label), ...]`` in time order (frees negative; ``label``: :data:`BACKEND`
    inside a ``c10d::``/``gloo:`` record or on a thread other than the step's, :data:`WORKSPACE` for
    an allocation whose free comes before the end of the innermost ``aten::`` record enclosing it,
    else :data:`CODE`; a free carries its allocation's label later, in :func:`_with_unseen_frees`),
    ``gloo_ends`` = sorted ``(start_ns, end_ns)`` of the ``gloo:*`` records (a worker's run of one
    collective) and ``window`` = (start, end, thread id) of the measured step's ``record_function``.
    Raises RuntimeError if that record is missing."""
    from torch._C._profiler import _EventType

    raw, spans, window = [], [], None
    todo = [(n, False, None) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        n, inside, op_end = todo.pop()
        if n.tag == _EventType.Allocation:
            if n.extra_fields.device.type == "cpu":
                f = n.extra_fields
                raw.append((n.start_time_ns, f.alloc_size, f.ptr, inside, n.start_tid, op_end))
            continue
        if n.name == _STEP:
            window = (n.start_time_ns, n.end_time_ns, n.start_tid)
        if n.name.startswith("gloo:"):
            spans.append((n.start_time_ns, n.end_time_ns))
        sub = inside or n.name.startswith(_BACKEND)
        end = n.end_time_ns if n.name.startswith("aten::") else op_end
        todo.extend((c, sub, end) for c in n.children)
    if window is None:
        raise RuntimeError(f"the profiler recorded no {_STEP!r} region")
    raw.sort()
    freed_at: dict = {}  # index of an allocation in raw -> time of its free (the next free at its address)
    open_at: dict = {}
    for i, (t, b, p, *_) in enumerate(raw):
        if b > 0:
            open_at[p] = i
        elif p in open_at:
            freed_at[open_at.pop(p)] = t
    allocs = []
    for i, (t, b, p, inside, tid, op_end) in enumerate(raw):
        label = BACKEND if inside or tid != window[2] else CODE
        if label == CODE and b > 0 and op_end is not None and freed_at.get(i, op_end + 1) <= op_end:
            label = WORKSPACE
        allocs.append((t, b, p, label))
    return allocs, sorted(spans), window


def _with_unseen_frees(allocs: list, live_ptrs: set, spans: list) -> tuple[list, list]:
    """``allocs`` (each free of a block labelled as its allocation: code, backend or workspace) plus a free
    for each block whose free the profiler missed (module docstring): at
    the end of the first ``gloo:*`` run that starts after its allocation, or earlier where its
    address is handed out again before that. Returns (events in time order, ``[(allocated at,
    bytes), ...]`` of those blocks)."""
    live: dict = {}   # ptr -> (time, bytes, label) of the block the running sum holds there
    lost: list = []   # (allocated at, bytes, ptr, label, reallocated at or None)
    events = []
    for t, b, p, label in allocs:
        if b > 0:
            if p in live:  # the address was handed out again: the block held there was freed
                lost.append((*live[p][:2], p, live[p][2], t))
            live[p] = (t, b, label)
        elif p in live:  # a free is the allocation's (its label), wherever it runs
            label = live.pop(p)[2]
        events.append((t, b, p, label))
    lost += [(t, b, p, label, None) for p, (t, b, label) in live.items() if p not in live_ptrs]
    starts = [s for s, _ in spans]
    added = []
    for t, b, p, label, again in lost:
        i = bisect.bisect_right(starts, t)
        when = spans[i][1] if i < len(spans) else t
        added.append((when if again is None else min(when, again), -b, p, label))
    return sorted(events + added), [(t, b) for t, b, *_ in lost]


def _live_storage_ptrs() -> set:
    """Data addresses of every tensor object alive now (parameters, gradients, optimizer state,
    flat buffers, batches, and the local tensors of DTensors)."""
    import gc
    import warnings

    out = set()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor):
                try:
                    out.add(o.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
                    pass
    return out


def measure_step_memory(cfg, steps: int = 2) -> dict:
    """On this rank of a real job (the default process group initialised, of the world size the
    layout needs): build the rank, run ``steps`` training steps on the dry run's synthetic batches
    and return the allocator's figures of the last one, in bytes, the backend's own buffers and the
    kernels' workspaces left out
    (module docstring): ``{"rank", "coords" (mesh coordinates), "held_at_step_start" (live before
    the step), "peak_bytes_measured" (the most live at once during the step), "end_of_step" (live
    after it), "backend_peak_bytes" (the most the backend held at once during the step),
    "unseen_frees" ({"count", "bytes"} of the blocks allocated in the step and freed on a gloo
    worker, see above),
    "model_state_bytes" (the strategy's own count), "comm" ({"op/group/tag": {"calls", "bytes"}} of
    the step from ``comm.STATS``), "loss"}``. Raises what building or training the layout raises."""
    import gc

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from zerotron.analysis.dryrun import build_rank, rank_batches
    from zerotron.distributed import comm
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
            if i == steps - 1:
                comm.STATS.reset()
            with record_function(_STEP if i == steps - 1 else f"{_STEP}.warm"):
                out = train_step(strategy, optimizer, sched, batches, mesh.group("batch"), cfg.train.grad_clip,
                                 cfg.train.dtype)
    traffic = {f"{op}/{group}/{tag}": {"calls": n, "bytes": comm.STATS.bytes[(op, group, tag)]}
               for (op, group, tag), n in sorted(comm.STATS.calls.items())}
    allocs, spans, (start, end, _) = _walk(prof)
    events, lost = _with_unseen_frees(allocs, _live_storage_ptrs(), spans)
    lost = [b for t, b in lost if start <= t <= end]
    live = {CODE: 0, BACKEND: 0, WORKSPACE: 0}
    before = peak = after = backend_peak = workspace_peak = 0
    for t, b, _, label in events:
        live[label] += b
        if t < start:
            before = peak = after = live[CODE]
        elif t <= end:
            peak, after = max(peak, live[CODE]), live[CODE]
            backend_peak = max(backend_peak, live[BACKEND])
            workspace_peak = max(workspace_peak, live[WORKSPACE])
    states = strategy.model_state_bytes(optimizer)
    return {"rank": dist.get_rank(), "coords": dict(mesh.coords), "held_at_step_start": before,
            "peak_bytes_measured": peak, "end_of_step": after, "backend_peak_bytes": backend_peak,
            "workspace_peak_bytes": workspace_peak,
            "unseen_frees": {"count": len(lost), "bytes": sum(lost)}, "model_state_bytes": states,
            "comm": traffic, "loss": out["loss"]}


def traced_comm(record: dict) -> dict:
    """A dry-run record's collectives (``zerotron dryrun --json``: ``comm_traced`` per group) in the form
    :func:`measure_step_memory` reports the real run's: ``{"op/group/tag": {"calls", "bytes"}}``, sorted."""
    out = {}
    for group, g in record["comm_traced"].items():
        for key, v in g["ops"].items():
            op, tag = key.split("/", 1)
            out[f"{op}/{group}/{tag}"] = {"calls": v["calls"], "bytes": v["bytes"]}
    return dict(sorted(out.items()))
