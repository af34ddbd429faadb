"""Pipeline idle time (the bubble) per rank for every schedule zerotron runs, priced for the
planner (``zerotron plan``) and ``zerotron memory``: closed forms where they hold (GPipe/1F1B,
interleaved, ZB-H1 from m = p on), the schedule simulator where they do not (ZB-V; ZB-H1 with
fewer micro-batches than stages). Sources and formulas: ``zerotron.parallel.pipeline.simulation``
(module docstring, ``bubble_theory``, ``bubble_time_theory``); every formula here is checked
against ``simulation.simulate`` in tests/test_zero_bubble_pricing.py.
"""
from __future__ import annotations

from functools import lru_cache

PIPELINE_KINDS = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")  # what the planner prices for pp > 1
NCCL_REFUSED = ("zb-v",)  # the runner refuses these on NCCL (parallel.pipeline.runner: gloo only)


@lru_cache(maxsize=1024)
def _simulated_idle(pp: int, m: int, kind: str, t_f: float, t_b: float, t_w: float) -> float:
    from zerotron.parallel.pipeline.schedules import build_schedule
    from zerotron.parallel.pipeline.simulation import simulate

    v = 2 if kind == "zb-v" else 1
    res = simulate(build_schedule(pp, m, kind, v), pp, v, t_f, t_b, t_w, eager_sends=True)
    return max(res.idle)


def _zb_v_idle(pp: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-V's simulated idle per rank; beyond m = 8pp (where a simulation costs seconds)
    extrapolated linearly from m0 = 6pp + m % pp and m0 + 2pp (its order is list-scheduled at unit
    costs: with T_B != T_W the idle grows by a fixed amount per micro-batch after the warm-up,
    and the steps repeat with period pp, nearly: measured against the simulator the bubble
    fraction is within 0.01, tests/test_zero_bubble_pricing.py)."""
    key = (round(t_f, 12), round(t_b, 12), round(t_w, 12))
    if m <= 8 * pp:
        return _simulated_idle(pp, m, "zb-v", *key)
    m0 = 6 * pp + m % pp
    i0, i1 = _simulated_idle(pp, m0, "zb-v", *key), _simulated_idle(pp, m0 + 2 * pp, "zb-v", *key)
    return i1 + (m - m0 - 2 * pp) * (i1 - i0) / (2 * pp)


def pipeline_idle(pp: int, m: int, kind: str, v: int = 1, t_f: float = 1.0, t_b: float = 1.0,
                  t_w: float = 1.0) -> float:
    """Idle time per pipeline rank of one flush of ``m`` micro-batches, uniform stages, ``t_f``,
    ``t_b`` (input gradient), ``t_w`` (weight gradients): a rank's costs per micro-batch (all its
    chunks), in any time unit; the executor's timing (sends not waited for).

    1f1b / gpipe / naive: (p-1)(T_F+T_B+T_W) (Huang et al. 2019; Narayanan et al. 2021);
    interleaved with v chunks: that over v (Narayanan et al. 2021); zb-h1: (p-1)max(T_F+T_B-T_W,
    T_F, T_B) for m >= p (Qi et al. 2024, sec. 3.1, for T_W <= min(T_F, T_B);
    ``simulation.bubble_time_theory``), simulated for m < p;
    zb-v: simulated (``simulation.simulate`` of its list-scheduled order, no closed form: 1 to 1.71
    times the synchronous-step bound (p-1)T_F/2 at unit costs; with T_B > T_W it grows with m, the
    order being fixed for unit costs), cached. Tested against ``simulate``.
    Raises ValueError for an unknown kind."""
    if kind not in PIPELINE_KINDS + ("naive",):
        raise ValueError(f"unknown pipeline schedule {kind!r}; known: {', '.join(PIPELINE_KINDS)}")
    if pp == 1:
        return 0.0
    if kind == "zb-v":
        return _zb_v_idle(pp, m, float(t_f), float(t_b), float(t_w))
    if kind == "zb-h1":  # the closed form holds from m = pp on; below, simulated
        if m < pp:
            return _simulated_idle(pp, m, kind, float(t_f), float(t_b), float(t_w))
        from zerotron.parallel.pipeline.simulation import bubble_time_theory  # (imports torch: lazily)

        return bubble_time_theory(pp, kind, t_f, t_b, t_w)
    return (pp - 1) * (t_f + t_b + t_w) / (v if kind == "interleaved" else 1)


def bubble_fraction(pp: int, m: int, kind: str, v: int = 1, t_f: float = 1.0, t_b: float = 1.0,
                    t_w: float = 1.0) -> float:
    """Idle / (busy + idle) of a rank over one flush: :func:`pipeline_idle` over itself plus m
    micro-batches of T_F+T_B+T_W (at unit costs for 1f1b, interleaved and zb-h1 the
    ``simulation.bubble_theory`` fractions)."""
    idle = pipeline_idle(pp, m, kind, v, t_f, t_b, t_w)
    return idle / (idle + m * (t_f + t_b + t_w))


def pipeline_time(stage_times: list[float], m: int, kind: str, v: int, split: tuple) -> float:
    """Seconds of the pipelined part of a step: ``m`` micro-batches through stages that take
    ``stage_times`` seconds per micro-batch each (all chunks of a rank), schedule ``kind``
    ("none" or one of ``PIPELINE_KINDS``) with ``v`` chunks per rank: m x max_r t_r + (sum_r t_r -
    max_r t_r) x rel, where rel is the schedule's idle (:func:`pipeline_idle`
    at the F : B : W cost ``split`` of a layer) relative to 1F1B's (p-1)(T_F+T_B+T_W): the
    slowest stage runs all m micro-batches, the fill and drain pass once through the others
    (:mod:`zerotron.analysis.cost_model`, Narayanan et al. 2021). One stage: m x t_0."""
    pp, stage = len(stage_times), max(stage_times)
    if pp == 1:
        return m * stage
    rel = pipeline_idle(pp, m, kind, v, *split) / ((pp - 1) * sum(split))
    return m * stage + (sum(stage_times) - stage) * rel
