"""The pipeline-bubble accounting of ``zerotron bench train``: what the schedule simulator predicts
from each timed step's measured per-stage times (:func:`simulated`), and where the measured idle
of the native executor goes (:func:`idle_split`). Inputs: the per-rank records ``run_layout``
gathers (``schedule``, ``stage_times``, ``split``, ``p2p``, ``pipe``, ``host``); definitions of
every statistic in ``zerotron.bench.train``'s docstring."""
from __future__ import annotations

import statistics

from zerotron.parallel.pipeline.accounting import merge_stage_times, predicted_bubble, recv_wait_split, replayed_bubble

__all__ = ["P2P_KEYS", "simulated", "idle_split"]


def simulated(got: list[dict], steps: int) -> dict:
    """Bubble predicted by the schedule simulator from the measured per-stage compute times of each
    timed step (stage times averaged over the ranks holding the stage), the same statistic as
    ``bubble_measured`` (max over ranks of the rank's idle / (busy + idle)); and the per-stage
    times themselves (median over steps, seconds per micro-batch)."""
    sched = got[0]["schedule"]
    merged = [merge_stage_times([g["stage_times"][i] for g in got]) for i in range(steps)]
    preds = [predicted_bubble(*sched, m)["max"] for m in merged]
    med = {k: {s: statistics.median(m[k][s] for m in merged) for s in st} for k, st in merged[0].items()}
    return {"bubble_simulated": statistics.median(preds), "bubble_simulated_steps": preds,
            "stage_compute_s": med, "pp_split": ",".join(map(str, got[0]["split"] or []))}


P2P_KEYS = ("busy_s", "idle_s", "post_s", "post_cpu_s", "recv_wait_s", "send_wait_s", "other_s", "walk_start_s", "p2p_events")


def idle_split(got: list[dict], steps: int) -> dict:
    """Where the measured idle goes (native executor only), per timed step on the rank whose idle
    fraction is the step's ``bubble_measured``, as fractions of that rank's walk (busy + idle):
    ``idle_dependency`` (receive waits before the sender posted: the bubble the simulator models),
    ``idle_transfer`` (receive waits after the send was posted: p2p latency, wake-ups), ``idle_post``
    (posting ops plus waiting for sends at the end; ``idle_post_cpu``: the CPU time of the posting,
    the rest of it the thread descheduled); the three add up to ``bubble_measured``.
    ``other_fraction``: executor bookkeeping outside busy and idle over the same walk;
    ``start_skew_ms``: how much later the last pp rank began its first walk than the first one.
    ``p2p_latency_ms``: the median one-way latency (send posted to receive complete) of the step's
    receives that were already waiting when their send was posted (``accounting.recv_wait_split``;
    NaN if none was), what each message on the critical path costs. ``bubble_replayed``: the same statistic as ``bubble_measured`` simulated with each action's own
    measured duration (``accounting.replayed_bubble``: jitter kept, communication free).
    ``bubble_sim_latency`` / ``bubble_replay_latency``: the simulation from the step's per-stage
    mean times and the replay, each with every cross-rank message taking the step's
    ``p2p_latency_ms`` (``simulate(..., latency=...)``; NaN without a latency);
    ``latency_ratio``: the step's measured idle fraction / ``bubble_sim_latency``, what is left of
    measured / simulated once the measured p2p latency is priced in (jitter, posting, skew). Medians
    over steps, from the pipeline at dp = tp = 0; {} if not every rank reports it or the ranks are
    on different hosts (perf_counter timestamps compare only within one host)."""
    if any(len(g.get("p2p") or []) != steps for g in got) or len({g["host"] for g in got}) > 1:
        return {}
    merged = [merge_stage_times([g["stage_times"][i] for g in got]) for i in range(steps)]
    got = sorted((g for g in got if g["pipe"][1:] == [0, 0]), key=lambda g: g["pipe"][0])  # one pipeline
    sched, rows, replay = got[0]["schedule"], [], []
    for i in range(steps):
        recs = [g["p2p"][i] for g in got]
        split = recv_wait_split([r["p2p_events"] for r in recs])
        lat = [x for part in split for x in part["latencies_s"]]
        replay.append(replayed_bubble(*sched, [r["p2p_events"] for r in recs])["max"])
        walks = [r["busy_s"] + r["idle_s"] for r in recs]
        top = max(range(len(recs)), key=lambda k: recs[k]["idle_s"] / walks[k] if walks[k] else 0.0)
        w, r = walks[top] or 1.0, recs[top]
        nan = float("nan")
        lat_s = statistics.median(lat) if lat else None
        sim_lat = predicted_bubble(*sched, merged[i], latency_s=lat_s)["max"] if lat_s is not None else nan
        rep_lat = (replayed_bubble(*sched, [r["p2p_events"] for r in recs], latency_s=lat_s)["max"]
                   if lat_s is not None else nan)
        rows.append({"bubble_sim_latency": sim_lat, "bubble_replay_latency": rep_lat,
                     "latency_ratio": r["idle_s"] / w / sim_lat if sim_lat == sim_lat and sim_lat > 0 else nan,
                     "idle_dependency": split[top]["dependency_s"] / w, "idle_transfer": split[top]["transfer_s"] / w,
                     "idle_post": (r["post_s"] + r["send_wait_s"]) / w,
                     "idle_post_cpu": r["post_cpu_s"] / w, "other_fraction": r["other_s"] / w,
                     "start_skew_ms": 1e3 * (max(x["walk_start_s"] for x in recs) - min(x["walk_start_s"] for x in recs)),
                     "p2p_latency_ms": 1e3 * lat_s if lat_s is not None else nan})
    def med(k):
        vals = [x[k] for x in rows if x[k] == x[k]]  # NaN: not measured that step
        return statistics.median(vals) if vals else float("nan")

    return ({k: med(k) for k in rows[0]}
            | {"idle_split_steps": rows, "bubble_replayed": statistics.median(replay), "bubble_replayed_steps": replay})
