"""Bubble accounting: what the schedule alone predicts from measured per-stage compute times.

A pipeline rank's measured idle fraction (``PipelineStrategy.last_step_timing()``) mixes three
things: the schedule's bubble for equal stages (the textbook (p-1)/(m+p-1), GPipe, Huang et al.
2019), the extra bubble of *unequal* stages (a slow stage makes its neighbours wait), and executor
overhead (p2p transfer, waits beyond the dependencies, start skew between ranks). Feeding the
event simulator (:func:`~zerotron.parallel.pipeline.simulation.simulate`) the measured mean time of
each model stage's F and B actions gives the first two together, with zero-cost communication;
``measured / predicted`` then isolates the executor overhead, and ``predicted / textbook`` the
imbalance. Two finer tools, from the executor's per-step timestamps: :func:`replayed_bubble`
simulates the step with each action's *own* measured duration (so compute jitter, which makes
neighbours wait beyond what the means predict, is not mistaken for executor overhead), and
:func:`recv_wait_split` splits the measured receive waits into waiting for the sender
(dependency) and waiting after the send was posted (p2p transfer).
"""
from __future__ import annotations

from zerotron.parallel.pipeline.schedules import build_schedule
from zerotron.parallel.pipeline.simulation import rank_idle_fractions, simulate

__all__ = ["merge_stage_times", "predicted_bubble", "recv_wait_split", "replayed_bubble"]


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


def predicted_bubble(pp: int, microbatches: int, kind: str, virtual_stages: int, stage_compute_s: dict,
                     latency_s: float = 0.0) -> dict:
    """Simulate the schedule ``(pp, microbatches, kind, virtual_stages)`` with model stage s's F/B
    (and any other compute kind the simulator takes as ``<kind>_cost``) costing
    ``stage_compute_s[kind][s]`` seconds per micro-batch.

    Returns ``{"per_rank": idle fraction of each rank's walk (the statistic the executor measures,
    :func:`~zerotron.parallel.pipeline.simulation.rank_idle_fractions`), "max": the largest of them,
    "mean": idle / (pp x makespan), "makespan_s": seconds of one flush}``. Sends complete in the
    background (``simulate(..., eager_sends=True)``, the executor's timing; zb-h1 depends on it).
    Communication is free unless ``latency_s`` > 0: then each cross-rank message takes that long
    from its send's post to its receiver (``simulate(..., latency=...)``; e.g. the median of
    :func:`recv_wait_split`'s ``latencies_s``), which separates the p2p latency on the critical
    path from the rest of the executor overhead.
    Raises ValueError if a model stage has no time for some kind (every stage runs F and B)."""
    n = pp * virtual_stages
    costs = {}
    for k, stages in stage_compute_s.items():
        missing = [s for s in range(n) if s not in stages]
        if missing:
            raise ValueError(f"no measured {k} time for model stage(s) {missing} of {n}")
        costs[f"{k.lower()}_cost"] = [stages[s] for s in range(n)]
    res = simulate(build_schedule(pp, microbatches, kind, virtual_stages), pp, virtual_stages, eager_sends=True,
                   latency=latency_s, **costs)
    per_rank = rank_idle_fractions(res)
    return {"per_rank": per_rank, "max": max(per_rank), "mean": res.bubble_fraction, "makespan_s": res.makespan}


def recv_wait_split(events_by_rank: list[list[tuple]]) -> list[dict]:
    """Split each pp rank's receive waits into the part spent waiting for the sender to post
    (``dependency_s``: the schedule's bubble, what :func:`predicted_bubble` models, including the
    sender's own lateness) and the part after it had posted (``transfer_s``: p2p latency and
    wake-ups, executor overhead the simulator does not model).

    ``events_by_rank[r]``: rank r's ``PipelineStrategy.last_step_timing()["p2p_events"]``
    (``("S", walk, key, t_issue)`` / ``("R", walk, key, t_wait_start, t_wait_end)``, seconds of
    ``time.perf_counter``, which only compares between processes of ONE host). For a receive waited
    from a to b whose send was posted at s: dependency = clamp(min(s, b) - a, 0), transfer =
    b - max(a, s) (>= 0). A receive without its send in the events (another host, a trimmed trace)
    counts as transfer. ``latencies_s``: b - s of each receive already waiting when its send was
    posted (a <= s <= b): the one-way p2p latency, issue to delivery, of that message. Returns one
    ``{"dependency_s", "transfer_s", "recvs", "latencies_s"}`` per rank."""
    sent = {}
    for evs in events_by_rank:
        for e in evs:
            if e[0] == "S":
                sent[(e[1], tuple(e[2]))] = e[3]
    out = []
    for evs in events_by_rank:
        dep = xfer = 0.0
        n, lat = 0, []
        for e in evs:
            if e[0] != "R":
                continue
            a, b, n = e[3], e[4], n + 1
            s = sent.get((e[1], tuple(e[2])), a)
            dep += max(min(s, b) - a, 0.0)
            xfer += max(b - max(a, s), 0.0)
            if a <= s <= b and (e[1], tuple(e[2])) in sent:
                lat.append(b - s)
        out.append({"dependency_s": dep, "transfer_s": xfer, "recvs": n, "latencies_s": lat})
    return out


def replayed_bubble(pp: int, microbatches: int, kind: str, virtual_stages: int,
                    events_by_rank: list[list[tuple]], latency_s: float = 0.0) -> dict:
    """The schedule simulated with every compute taking exactly its measured duration in one
    step's walks (``("C", walk, (kind, microbatch, model stage), t_start, t_end)`` events of
    ``PipelineStrategy.last_step_timing()["p2p_events"]``, one list per pp rank of one pipeline,
    in pp order) and communication free (unless ``latency_s``): the idle the schedule would have had with this step's
    own compute times, jitter included. ``measured / replayed`` is then executor overhead alone
    (p2p latency, posting, start skew, bookkeeping), while ``measured / predicted_bubble`` also
    counts the extra waits that compute-time variation causes around the per-stage means.

    Each walk (pipeline flush) is simulated separately; per rank, idle and busy are summed over
    the walks; ``latency_s`` > 0 delays each cross-rank message by that much, as in
    :func:`predicted_bubble`. Returns ``{"per_rank": idle / (busy + idle) of each rank, "max": the largest}``.
    Raises ValueError if a walk lacks a rank's events."""
    sched = build_schedule(pp, microbatches, kind, virtual_stages)
    walks = sorted({e[1] for evs in events_by_rank for e in evs if e[0] == "C"})
    idle, busy = [0.0] * pp, [0.0] * pp
    for w in walks:
        dur = {}
        for r, evs in enumerate(events_by_rank):
            got = [e for e in evs if e[0] == "C" and e[1] == w]
            if not got:
                raise ValueError(f"no compute events of rank {r} in walk {w}")
            dur.update({tuple(e[2]): e[4] - e[3] for e in got})
        res = simulate(sched, pp, virtual_stages, eager_sends=True, durations=dur, latency=latency_s)
        for r, iv in enumerate(res.intervals):
            end = iv[-1][1] if iv else 0.0
            b = sum(e - s for s, e, _ in iv)
            busy[r] += b
            idle[r] += end - b
    per_rank = [i / (i + b) if i + b > 0 else 0.0 for i, b in zip(idle, busy)]
    return {"per_rank": per_rank, "max": max(per_rank)}
