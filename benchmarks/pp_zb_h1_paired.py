"""ZB-H1 vs 1F1B, alternated step by step in the same two processes (pp = 2, default model shape,
micro-batch 2, m = 8): the paired per-round ratio of step wall times, robust to a loaded machine.

Usage: ``ROUNDS=13 PYTHONPATH=. python benchmarks/pp_zb_h1_paired.py``. Each round times one
forward_backward + finish_grads step of each schedule (order swapped every round) between
barriers; the first round is a warm-up. Prints per rank the medians (wall, busy, idle ms) and
``ratio_zb_vs_1f1b`` = median over rounds of wall(1f1b) / wall(zb-h1) (= tokens/s zb / 1f1b).
Results: ``benchmarks/pp_zb_h1_cpu.md``."""
import os
import statistics
import time

import torch

from zerotron.testing import run_ranks

KINDS = ("1f1b", "zb-h1")


def work(rounds: int) -> dict:
    import torch.distributed as dist

    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.parallel.pipeline.runner import PipelineStrategy
    from zerotron.plan import ParallelPlan

    torch.set_num_threads(1)
    mesh = Mesh(ParallelDims(2, 1, 1, 2), torch.device("cpu"))
    strategies, res = {}, {k: [] for k in KINDS}
    for kind in KINDS:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0))
        strategies[kind] = PipelineStrategy(model, mesh, ParallelPlan(mesh.dims, pp_schedule=kind))
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 4096, (2, 128), generator=g), torch.randint(0, 4096, (2, 128), generator=g))
           for _ in range(8)]
    for rnd in range(rounds):
        for kind in KINDS if rnd % 2 == 0 else KINDS[::-1]:
            s = strategies[kind]
            dist.barrier()
            t0 = time.perf_counter()
            s.zero_grad()
            s.forward_backward(mbs, 2048, "fp32", torch.device("cpu"))
            s.finish_grads()
            dist.barrier()
            wall, tm = time.perf_counter() - t0, s.last_step_timing()
            if rnd:
                res[kind].append((wall, tm["busy_s"], tm["idle_s"]))
    ratios = [a[0] / b[0] for a, b in zip(res["1f1b"], res["zb-h1"])]
    out = {k: [round(statistics.median(x[i] for x in v) * 1e3, 1) for i in range(3)] for k, v in res.items()}
    return {**out, "ratio_zb_vs_1f1b": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios]}


if __name__ == "__main__":
    for r, o in enumerate(run_ranks(work, 2, int(os.environ.get("ROUNDS", "6")), timeout_s=120)):
        print("rank", r, "wall/busy/idle ms", o)
