"""Timing helpers shared by ``bench comm`` and its ``--topology`` mode: nccl-tests sizes and
bandwidths, back-to-back loop timing, and the loop-time noise measures."""
from __future__ import annotations

import statistics
import time

import torch

from zerotron.distributed import comm
from zerotron.distributed.accounting import busbw_factor


def format_size(nbytes: int) -> str:
    """``4096 -> "4KiB"``; the largest binary unit dividing ``nbytes`` exactly, else ``"<n>B"``."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= f and nbytes % f == 0:
            return f"{nbytes // f}{unit}"
    return f"{nbytes}B"



def bandwidths(op: str, nbytes: int, time_s: float, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes/s) of ``op`` moving ``nbytes`` (nccl-tests size) in
    ``time_s`` seconds on ``n`` ranks: algbw = nbytes / time_s, busbw = algbw x busbw_factor(op, n)
    (nccl-tests doc/PERFORMANCE.md). Raises ValueError for time_s <= 0 or an unknown op."""
    if not time_s > 0:
        raise ValueError(f"bandwidths: time_s must be > 0, got {time_s}")
    algbw = nbytes / time_s / 1e9
    return algbw, algbw * busbw_factor(op, n)



def actual_bytes(nbytes: int, n: int) -> int:
    """``nbytes`` rounded down to a multiple of 4*n (whole float32 shards per rank), at least 4*n."""
    return max(4 * n, nbytes // (4 * n) * (4 * n))



def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)



def timing_noise(times: list[float]) -> tuple[float, float]:
    """``(max/min, coefficient of variation)`` of repeated timings of one thing (seconds, > 0);
    the CV is the population stdev / mean. ``(1.0, 0.0)`` for fewer than 2 timings."""
    if len(times) < 2:
        return 1.0, 0.0
    lo, mean = min(times), statistics.fmean(times)
    spread = max(times) / lo if lo > 0 else float("inf")
    return spread, (statistics.pstdev(times) / mean if mean > 0 else 0.0)



def _median_time(fn, iters: int, warmup: int, dev, barrier: bool = True, loops: int = 3) -> float:
    """Seconds per ``fn()`` call: the median of :func:`_loop_times`."""
    return statistics.median(_loop_times(fn, iters, warmup, dev, barrier, loops))



def _loop_times(fn, iters: int, warmup: int, dev, barrier: bool = True, loops: int = 3) -> list[float]:
    """Seconds per ``fn()`` call in each loop, nccl-tests style: ``warmup`` calls, then ``loops``
    loops of ``max(1, iters // loops)`` back-to-back calls (a barrier before each loop when
    ``barrier``), each loop's time / its calls."""
    for _ in range(warmup):
        fn()
    k, ts = max(1, iters // loops), []
    for _ in range(loops):
        if barrier:
            comm.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        _sync(dev)
        ts.append((time.perf_counter() - t0) / k)
    return ts
