"""This process's compute profile for the planner's CPU validation (``zerotron bench plan``):
matmul peak, the model's matmul efficiency, elementwise rate and per-layer overhead, each
measured by a micro-benchmark (never from the training run the planner is judged against)."""
from __future__ import annotations

import statistics
import time

from zerotron.analysis.hardware import measure_vector_rate


def gemm_efficiency(rows: int, h: int, peak_flops: float, iters: int = 10) -> float:
    """Measured FLOP/s of this process on the model's MLP matmul, (rows, h) @ (h, 4h) (best of
    ``iters``), over ``peak_flops``: the planner's ``compute_eff`` for this model here."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, h, generator=gen), torch.randn(h, 4 * h, generator=gen)
    best = float("inf")
    for _ in range(iters + 1):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return min(1.0, 2 * rows * h * 4 * h / best / peak_flops)


def layer_overhead_s(cfg, iters: int = 20) -> float:
    """Fixed cost (seconds) of one transformer block's forward + backward on this process: the
    median over ``iters`` runs on a single token (framework dispatch, not arithmetic): the
    planner's ``launch_s``."""
    import torch

    from zerotron.models.gpt import Block

    torch.manual_seed(0)
    block, x = Block(cfg), torch.randn(1, 1, cfg.n_embd, requires_grad=True)
    ts = []
    for _ in range(iters + 2):
        t = time.perf_counter()
        block(x).sum().backward()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[2:])


def measure_profile(cfg, micro_batch: int, threads: int, peak_flops: float | None = None) -> dict:
    """This machine's compute profile with ``threads`` intra-op threads: ``peak_flops`` (best of
    10 fp32 1024^3 matmuls unless given), ``compute_eff`` (:func:`gemm_efficiency` at rows =
    micro_batch x block_size), ``vector_rate``
    (:func:`~zerotron.analysis.hardware.measure_vector_rate` at the model's sizes) and
    ``launch_s`` (:func:`layer_overhead_s`)."""
    import torch

    from zerotron.train.metrics import measure_peak_flops

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = micro_batch * cfg.block_size
        peak = peak_flops or measure_peak_flops(torch.device("cpu"), n=1024, iters=10)
        return {"peak_flops": peak, "compute_eff": gemm_efficiency(rows, cfg.n_embd, peak),
                "vector_rate": measure_vector_rate(rows, 4 * cfg.n_embd, cfg.vocab_size),
                "launch_s": layer_overhead_s(cfg), "threads": threads}
    finally:
        torch.set_num_threads(prev)
