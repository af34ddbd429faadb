"""Bubble accounting: what the schedule alone predicts from measured per-stage compute times.

A pipeline rank's measured idle fraction (``PipelineStrategy.last_step_timing()``) mixes three
things: the schedule's bubble for equal stages (the textbook (p-1)/(m+p-1), GPipe, Huang et al.
2019), the extra bubble of *unequal* stages (a slow stage makes its neighbours wait), and executor
overhead (p2p transfer, waits beyond the dependencies, start skew between ranks). Feeding the
event simulator (:func:`~zerotron.parallel.pipeline.schedules.simulate`) the measured mean time of
each model stage's F and B actions gives the first two together, with zero-cost communication;
``measured / predicted`` then isolates the executor overhead, and ``predicted / textbook`` the
imbalance.
"""
from __future__ import annotations

from zerotron.parallel.pipeline.schedules import build_schedule, rank_idle_fractions, simulate

__all__ = ["merge_stage_times", "predicted_bubble"]


def merge_stage_times(parts: list[dict]) -> dict:
    """Per-rank ``stage_compute_s`` dicts (``{kind: {model stage: seconds}}``, e.g. one per pp rank,
    several per stage with dp or tp replicas) -> one dict, each stage's time averaged over the
    ranks that report it."""
    sums: dict = {}
    for part in parts:
        for kind, stages in part.items():
            for s, sec in stages.items():
                acc = sums.setdefault(kind, {}).setdefault(int(s), [0.0, 0])
                acc[0] += sec
                acc[1] += 1
    return {k: {s: a[0] / a[1] for s, a in sorted(st.items())} for k, st in sums.items()}


def predicted_bubble(pp: int, microbatches: int, kind: str, virtual_stages: int, stage_compute_s: dict) -> dict:
    """Simulate the schedule ``(pp, microbatches, kind, virtual_stages)`` with model stage s's F/B
    (and any other compute kind the simulator takes as ``<kind>_cost``) costing
    ``stage_compute_s[kind][s]`` seconds per micro-batch.

    Returns ``{"per_rank": idle fraction of each rank's walk (the statistic the executor measures,
    :func:`~zerotron.parallel.pipeline.schedules.rank_idle_fractions`), "max": the largest of them,
    "mean": idle / (pp x makespan), "makespan_s": seconds of one flush}``. Raises ValueError if a
    model stage has no time for some kind (every stage runs F and B)."""
    n = pp * virtual_stages
    costs = {}
    for k, stages in stage_compute_s.items():
        missing = [s for s in range(n) if s not in stages]
        if missing:
            raise ValueError(f"no measured {k} time for model stage(s) {missing} of {n}")
        costs[f"{k.lower()}_cost"] = [stages[s] for s in range(n)]
    res = simulate(build_schedule(pp, microbatches, kind, virtual_stages), pp, virtual_stages, **costs)
    per_rank = rank_idle_fractions(res)
    return {"per_rank": per_rank, "max": max(per_rank), "mean": res.bubble_fraction, "makespan_s": res.makespan}
