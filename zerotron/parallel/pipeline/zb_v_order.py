"""ZB-V's compute order (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 6): two model
stages per rank in a V, rank r running stages r and 2p-1-r, each backward split into B (input
gradient) and W (weight gradients).

The order comes from list scheduling at unit costs (F = B = W = 1 per stage): whenever a rank is
free it runs a ready B (the deeper stage first), else a ready F (deeper first) while it holds fewer
than 2p stage activations (1F1B's peak: p micro-batches of the rank's whole share), else its oldest
owed W. Events are taken in global start order, so every choice sees everything that finished
before it. Pure arithmetic; ``pipeline.schedules.build_schedule`` adds the communication and the
FIFO order of receives.
"""
from __future__ import annotations

__all__ = ["zb_v_groups"]


def zb_v_groups(pp: int, m: int) -> list[list[list[tuple]]]:
    """ZB-V compute order of every rank: ``[rank][group] = [(kind, microbatch, chunk)]`` (one compute
    per group; chunk 0 = stage r, chunk 1 = stage 2p-1-r), by list scheduling at unit costs (module
    docstring) with at most 2p chunk activations per rank, the cap raised by one if it ever leaves
    no rank anything to run."""
    n = 2 * pp
    for cap in range(n, n + 2 * m * n + 1):
        out = _zb_v_list_schedule(pp, m, cap)
        if out is not None:
            return [[[(k, i, 0 if s < pp else 1)] for k, i, s in rank] for rank in out]
    raise AssertionError("unreachable: without a memory cap list scheduling always progresses")


def _zb_v_list_schedule(pp: int, m: int, cap: int):
    """Per-rank ``[(kind, microbatch, model stage)]`` in start order, or None if the cap stalls."""
    n = 2 * pp
    done: dict = {}  # (kind, microbatch, stage) -> end time
    clock = [0] * pp
    next_f, next_b = [0] * n, [0] * n
    owed: list[list] = [[] for _ in range(pp)]
    live, order = [0] * pp, [[] for _ in range(pp)]
    for _ in range(3 * m * n):
        best = None
        for r in range(pp):
            cands = []
            for s in (n - 1 - r, r):  # deeper stage first
                i = next_b[s]
                if i < m and ("F", i, s) in done and (s == n - 1 or ("B", i, s + 1) in done):
                    cands.append((max(clock[r], done[("F", i, s)], done.get(("B", i, s + 1), 0)), 0, "B", i, s))
                i = next_f[s]
                if i < m and live[r] < cap and (s == 0 or ("F", i, s - 1) in done):
                    cands.append((max(clock[r], done.get(("F", i, s - 1), 0)), 1, "F", i, s))
            if owed[r]:
                cands.append((clock[r], 2, "W", *owed[r][0]))
            if cands:
                c = min(cands, key=lambda x: x[:2])
                if best is None or c[:2] < best[0][:2]:
                    best = (c, r)
        if best is None:
            return None
        (t, _, k, i, s), r = best
        clock[r] = done[(k, i, s)] = t + 1
        order[r].append((k, i, s))
        if k == "F":
            next_f[s] += 1
            live[r] += 1
        elif k == "B":
            next_b[s] += 1
            owed[r].append((i, s))
        else:
            owed[r].pop(0)
            live[r] -= 1
    return order
