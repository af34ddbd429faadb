"""Event simulation of a pipeline schedule (``pipeline.schedules``) and the bubble theory it is
checked against: pure functions, no process groups.

Bubble theory per rank, uniform stage costs T_F, T_B (input gradient), T_W (weight gradients): 1F1B
idles (p-1)(T_F+T_B+T_W) (its fused backward costs T_B+T_W and the whole chain waits for it); ZB-H1
idles (p-1)(T_F+T_B-T_W) when T_W <= T_B (Qi et al. 2024, sec. 3.1): rank i keeps i W's
back during the steady state (in flight at most p micro-batches, as 1F1B's rank 0) and runs them
after its last B, so the critical path goes through the B's alone. With T_F = T_B = T_W that is a
third of 1F1B's bubble time (:func:`bubble_time_theory`).

ZB-V's compute order is list-scheduled at unit costs (``pipeline.zb_v_order``). Measured with this simulator at unit costs, m = p..3p (tested): per rank
it idles 1 to 1.71 times the bound (p-1) T_F / 2 below (exactly the bound at p = 2), ZB-H1 twice
it, (p-1) T_F. Its peak is 2p chunk activations per rank, 1F1B's p micro-batches of a whole rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.parallel.pipeline.schedules import COMM, COMPUTE, Action, message_key, placement_of


@dataclass
class SimResult:
    """Outcome of :func:`simulate`. ``intervals[r]``: (start, end, action) of each compute on rank r
    (time units of f_cost/b_cost/w_cost); ``makespan``: end of the last compute;
    ``bubble_fraction``: idle / (pp * makespan); ``idle[r]``: makespan minus rank r's busy time;
    ``peak_in_flight[r]``: max count of (microbatch, chunk) pairs whose F is done and whose
    backward (B, or W when split) is not yet done on rank r (activations held)."""

    intervals: list
    makespan: float
    bubble_fraction: float
    peak_in_flight: list
    idle: list


def simulate(schedule: list[list[Action]], pp: int, virtual_stages: int = 1,
             f_cost: float | list[float] = 1.0, b_cost: float | list[float] = 2.0,
             w_cost: float | list[float] = 0.0, eager_sends: bool = False,
             durations: dict | None = None, latency: float = 0.0) -> SimResult:
    """Event simulation of ``schedule`` (one list per rank, walked in order, one compute at a time).

    Dependencies: F of stage s for micro-batch i after F of stage s-1 for i; B of stage s after B of
    stage s+1 and after its own F; W after its own B. Costs per micro-batch and stage: f_cost (F),
    b_cost (B, the input gradient), w_cost (W, the weight gradients); a B without a W in the
    schedule is the whole backward and costs b_cost + w_cost (so the default w_cost = 0 makes b_cost
    the whole backward); a chunk's costs are divided by v = virtual_stages; or, when a cost is a
    list of pp*v numbers, model stage s costs ``cost[s]`` per micro-batch (e.g. measured per-stage
    times, so an unbalanced split shows its extra bubble). Communication costs 0 (unless ``latency``) but follows the
    executor contract of the module docstring: a comm run is posted at once and left only when
    every op in it has its counterpart posted (rendezvous), so no deadlock here means none under
    NCCL-like batches either. With ``eager_sends`` a run is left once its RECVs have their SENDs
    posted (the SENDs complete in the background): the timing of ``PipelineExecutor``, which waits
    only for the received tensors (and for its sends at the end of the walk). Times are in the
    units of the costs (e.g. seconds). ``durations``, when given, overrides the costs per action:
    ``durations[(kind, microbatch, model stage)]`` is the duration of that compute (a fused B's
    whole backward under "B"), e.g. each action's measured time of one executor walk, so a replay
    keeps the run's jitter and only the communication becomes free; actions missing from it
    use the costs. ``latency`` (same units) is the one-way time of every cross-rank message: a
    RECV is satisfied ``latency`` after its SEND was posted (a SEND waiting for its RECV's post,
    without ``eager_sends``, is not delayed), e.g. the p2p latency measured for the run
    (``accounting.recv_wait_split``), so the prediction includes what each message on the critical
    path costs. Model stages follow the schedule's placement (``schedules.placement_of``).
    Raises RuntimeError("deadlock ...") if no rank can
    progress, ValueError for a wrong number of rank lists, v < 1, a negative cost or latency, or a
    cost list of the wrong length.
    """
    if len(schedule) != pp or virtual_stages < 1:
        raise ValueError(f"expected {pp} rank lists and virtual_stages >= 1, got "
                         f"{len(schedule)} lists, virtual_stages={virtual_stages}")
    v, last = virtual_stages, pp * virtual_stages - 1
    place = placement_of(schedule, pp, v)
    split = [{(a.microbatch, a.chunk) for a in acts if a.kind == "W"} for acts in schedule]

    def per_stage(c, name):
        if isinstance(c, (int, float)):
            return [c / v] * (last + 1)
        if len(c) != last + 1:
            raise ValueError(f"{name} needs one cost per model stage (pp * virtual_stages = {last + 1}), got {len(c)}")
        return [float(x) for x in c]
    cost = {"F": per_stage(f_cost, "f_cost"), "B": per_stage(b_cost, "b_cost"), "W": per_stage(w_cost, "w_cost")}
    if min(min(c) for c in cost.values()) < 0 or latency < 0:
        raise ValueError(f"costs and latency must be >= 0, got f_cost={f_cost}, b_cost={b_cost}, "
                         f"w_cost={w_cost}, latency={latency}")
    cost["BW"] = [b + w for b, w in zip(cost["B"], cost["W"])]
    pos, clock = [0] * pp, [0.0] * pp
    done: dict = {}    # (kind, microbatch, stage) -> end time
    posted: dict = {}  # (message key, is_send) -> post time
    intervals: list = [[] for _ in range(pp)]
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            acts = schedule[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind in COMPUTE:
                    s, i = place.stage_of(r, a.chunk), a.microbatch
                    if a.kind == "F":
                        deps = [("F", i, s - 1)] if s > 0 else []
                    elif a.kind == "W":
                        deps = [("B", i, s)]
                    else:
                        deps = [("F", i, s)] + ([("B", i, s + 1)] if s < last else [])
                    if any(d not in done for d in deps):
                        break
                    start = max([clock[r]] + [done[d] for d in deps])
                    fused = a.kind == "B" and (i, a.chunk) not in split[r]
                    dur = durations.get((a.kind, i, s)) if durations else None
                    if dur is None:
                        dur = cost["BW" if fused else a.kind][s]
                    clock[r] = done[(a.kind, i, s)] = start + dur
                    intervals[r].append((start, clock[r], a))
                    pos[r] += 1
                    progress = True
                    continue
                end = pos[r]
                while end < len(acts) and acts[end].kind in COMM:
                    end += 1
                run = acts[pos[r]:end]
                mine = [(message_key(x, r, place), x.kind.startswith("SEND")) for x in run]
                for k in mine:
                    if k not in posted:
                        posted[k] = clock[r]
                        progress = True
                theirs = [(key, not is_send) for key, is_send in mine if not (eager_sends and is_send)]
                if any(k not in posted for k in theirs):
                    break
                # theirs[i][1]: the counterpart is a SEND, i.e. this op receives: delivery takes latency
                clock[r] = max([clock[r]] + [posted[k] + (latency if k[1] else 0.0) for k in theirs])
                pos[r] = end
        if not progress:
            stuck = {r: schedule[r][pos[r]] for r in range(pp) if pos[r] < len(schedule[r])}
            raise RuntimeError(f"deadlock: no rank can progress; next actions {stuck}")
    makespan = max((iv[-1][1] for iv in intervals if iv), default=0.0)
    busy = sum(e - s for iv in intervals for s, e, _ in iv)
    bubble = (pp * makespan - busy) / (pp * makespan) if makespan > 0 else 0.0
    peaks = []
    for r, iv in enumerate(intervals):
        live = peak = 0
        for _, _, a in iv:
            ends = a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in split[r])
            live += 1 if a.kind == "F" else -1 if ends else 0
            peak = max(peak, live)
        peaks.append(peak)
    idle = [makespan - sum(e - s for s, e, _ in iv) for iv in intervals]
    return SimResult(intervals, makespan, bubble, peaks, idle)


def rank_idle_fractions(result: SimResult) -> list[float]:
    """Per rank of a :func:`simulate` result: idle / (busy + idle) of the rank's own walk, from time
    0 to the end of its last compute -- the statistic an executor measures per rank
    (``PipelineStrategy.last_step_timing()["bubble_fraction"]``), unlike ``bubble_fraction``, which
    divides the idle time of all ranks by pp x makespan."""
    out = []
    for iv in result.intervals:
        end = iv[-1][1] if iv else 0.0
        busy = sum(e - s for s, e, _ in iv)
        out.append((end - busy) / end if end > 0 else 0.0)
    return out


def bubble_theory(pp: int, microbatches: int, virtual_stages: int = 1, kind: str = "1f1b") -> float:
    """Idle fraction of the pipeline, idle / (pp * makespan), for uniform stage costs.

    ``kind`` "zb-h1" (T_F = T_B = T_W, Qi et al. 2024): idle per rank (p-1)(T_F+T_B-T_W) = (p-1)
    over busy 3m, i.e. (p-1)/(3m + p - 1) (m >= p; :func:`bubble_time_theory`); "zb-v": the
    synchronous-step lower bound (p-1) T_F / 2 over busy 3m, (p-1)/(6m + p - 1), which its order
    reaches at p = 2 (1 to 1.71 times it for p = 3..8, module docstring); every other kind as follows.

    v == 1 (naive, GPipe, 1F1B): (p-1)/(m+p-1) (GPipe, Huang et al. 2019; same bubble for
    PipeDream-Flush, Narayanan et al. 2021). Interleaved with v chunks per rank:
    (p-1)/(v*m + p - 1). Megatron-LM (Narayanan et al. 2021) reports instead the ratio
    bubble time / ideal time = (1/v)*(p-1)/m; the two agree: with ideal time m*(tf+tb) and bubble
    (p-1)*(tf+tb)/v, idle fraction = ratio / (1 + ratio). Raises ValueError for sizes < 1.
    """
    if min(pp, microbatches, virtual_stages) < 1:
        raise ValueError("pp, microbatches and virtual_stages must be >= 1")
    if kind == "zb-h1":
        return (pp - 1) / (3 * microbatches + pp - 1)
    if kind == "zb-v":  # the synchronous-step bound (p-1) T_F / 2 over busy 3m T_F (module docstring)
        return (pp - 1) / (6 * microbatches + pp - 1)
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def bubble_time_theory(pp: int, kind: str, f_cost: float = 1.0, b_cost: float = 1.0,
                       w_cost: float = 1.0) -> float:
    """Idle time per rank for uniform stage costs (units of the costs), any m >= pp, sends not
    waited for (``simulate(..., eager_sends=True)``, the executor's timing).

    "gpipe"/"1f1b": (p-1)(T_F+T_B+T_W) (Huang et al. 2019; Narayanan et al. 2021), the backward
    fused. "zb-h1": (p-1)(T_F+T_B-T_W) (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv
    2401.10241, sec. 3.1) when T_W <= min(T_F, T_B); otherwise the W's cannot cover what they must:
    the last rank still waits (p-1)T_F for its first forward, and the first rank (p-1)T_B for the
    chain of input gradients -- (p-1)max(T_F+T_B-T_W, T_F, T_B) in general (equal to
    :func:`simulate` for every rank's worst idle on 1,500 random (p, m >= p, costs), tested). Raises
    ValueError for another kind, pp < 1 or a negative cost."""
    if pp < 1 or min(f_cost, b_cost, w_cost) < 0:
        raise ValueError(f"need pp >= 1 and costs >= 0, got pp={pp}, costs {f_cost}, {b_cost}, {w_cost}")
    if kind in ("gpipe", "1f1b"):
        return (pp - 1) * (f_cost + b_cost + w_cost)
    if kind == "zb-h1":
        return (pp - 1) * max(f_cost + b_cost - w_cost, f_cost, b_cost)
    raise ValueError(f"bubble_time_theory knows gpipe, 1f1b and zb-h1, not {kind!r}")
