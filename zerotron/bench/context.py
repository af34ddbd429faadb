"""Load balance of ring attention (issue 28): per-rank attention time, forward + backward, under the
zigzag split and under the plain contiguous split. Not yet wired to the CLI.

Method. Each cp rank builds random q, k, v of its T/cp tokens (``batch``, ``heads``, ``kv_heads``,
``head_dim``, ``dtype``), runs ``warmup`` untimed iterations of
:func:`zerotron.parallel.context.ring.ring_attention` forward + backward, then ``repeats`` timed
ones. Per iteration it records the block-compute seconds the ring reports (``timings``: the
attention a rank does itself, waits excluded), the seconds spent waiting for transfers, and the
wall time of the iteration (which a synchronous ring evens out: a rank with less work waits for its
peers, so the wall time cannot show the imbalance; the compute time does). Each rank's figure is
the median over the timed iterations. Imbalance = max / min of the ranks' compute times (1.0 is
perfect balance). Ranks run with one intra-op thread each (``zerotron.testing.run_ranks``): an idle
machine with a core per rank gives the clean figure.
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["attention_balance", "rank_attention_times"]


def rank_attention_times(group, seq_len: int, layout: str = "zigzag", *, batch: int = 1, heads: int = 8,
                         kv_heads: int | None = None, head_dim: int = 64, dtype: torch.dtype = torch.float32,
                         repeats: int = 5, warmup: int = 1, seed: int = 0) -> dict:
    """On one rank of the cp ``group`` (all ranks call it): time ring attention forward + backward
    of a local (batch, heads, seq_len/cp, head_dim) block (module doc). Returns a dict of medians
    over ``repeats`` iterations, in seconds: ``compute_s`` (forward + backward block compute;
    ``compute_min_s`` its minimum, the least disturbed on a shared machine),
    ``forward_compute_s``, ``backward_compute_s``, ``wait_s`` (transfer waits), ``wall_s``;
    plus ``rank`` (in the group), ``layout`` and ``work_blocks`` (``ring.rank_work``: the
    computed score blocks, the expected time ratio between ranks). Raises ValueError as ring_attention does."""
    from zerotron.distributed import comm
    from zerotron.distributed.groups import process_group
    from zerotron.parallel.context.ring import rank_work, ring_attention

    cp, rank = group.size(), group.rank()
    t = seq_len // cp
    gen = torch.Generator().manual_seed(seed + rank)
    q = torch.randn(batch, heads, t, head_dim, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads or heads, t, head_dim, generator=gen).to(dtype).requires_grad_()
            for _ in range(2))
    dout = torch.randn(batch, heads, t, head_dim, generator=gen).to(dtype)
    rows = []
    for i in range(warmup + repeats):
        comm.barrier(process_group(group))
        timings: dict = {}
        t0 = time.perf_counter()
        ring_attention(q, k, v, group, layout=layout, timings=timings).backward(dout)
        wall = time.perf_counter() - t0
        if i >= warmup:
            rows.append(dict(timings, wall_s=wall))
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    compute = [r["forward_compute_s"] + r["backward_compute_s"] for r in rows]
    return {"rank": rank, "layout": layout, "work_blocks": rank_work(layout, cp, rank),
            "compute_s": statistics.median(compute), "compute_min_s": min(compute),
            "forward_compute_s": med["forward_compute_s"], "backward_compute_s": med["backward_compute_s"],
            "wait_s": med["forward_wait_s"] + med["backward_wait_s"], "wall_s": med["wall_s"]}


def _ranks(seq_len, layouts, kwargs):
    import torch.distributed as dist

    from zerotron.distributed.comm import NamedGroup

    group = NamedGroup(dist.group.WORLD, "cp")
    return {layout: rank_attention_times(group, seq_len, layout, **kwargs) for layout in layouts}


def attention_balance(cp: int, seq_len: int, layouts=("zigzag", "contiguous"), **kwargs) -> dict:
    """Spawn ``cp`` local gloo ranks and measure :func:`rank_attention_times` for each layout
    (keyword arguments passed on). Returns ``{layout: {"ranks": [per-rank dict, ...], "imbalance":
    max/min compute_s over ranks, "imbalance_min": the same of compute_min_s, "work_imbalance":
    max/min of work_blocks}}``. Raises RuntimeError if a rank fails."""
    from zerotron.testing import run_ranks

    per_rank = run_ranks(_ranks, cp, seq_len, tuple(layouts), kwargs, timeout_s=600)
    out = {}
    for layout in layouts:
        ranks = [r[layout] for r in per_rank]
        times = [r["compute_s"] for r in ranks]
        best = [r["compute_min_s"] for r in ranks]
        work = [r["work_blocks"] for r in ranks]
        out[layout] = {"ranks": ranks, "imbalance": max(times) / min(times), "imbalance_min": max(best) / min(best),
                       "work_imbalance": max(work) / min(work)}
    return out


if __name__ == "__main__":  # python -m zerotron.bench.context [cp seq_len repeats]
    import json
    import sys

    cp_, seq_, reps = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (2, 2048, 5)))
    print(json.dumps(attention_balance(cp_, seq_, repeats=reps), indent=1))
