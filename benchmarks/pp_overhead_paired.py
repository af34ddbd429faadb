"""The pipeline executor's p2p posting modes (and 1F1B vs ZB-H1), alternated step by step in the
same two processes (pp = 2, default model shape, auto split, micro-batch 2, m = 8): paired per-round
ratios of step wall times, robust to a loaded machine (adjacent steps see the same load).

Modes (``pipeline.p2p.CommRunPoster``): "prefetch" (the gloo default: ops posted one by one, the
next comm run's receives posted one compute group early), "batched" (one batch_isend_irecv per comm
run, receives posted just before they are needed: the executor before this change, and the NCCL
path), "eager" (one by one, no early receives).

Usage: ``ROUNDS=25 PYTHONPATH=. python benchmarks/pp_overhead_paired.py [out.json]``. Each round
times one forward_backward + finish_grads step of every (schedule, mode) between barriers, the order
rotated every round; the first round is a warm-up. Per rank: medians of wall, busy, idle, post and
post-CPU ms per (schedule, mode), and ``ratio[a / b]`` = median over rounds of wall(b) / wall(a)
(= tokens/s a / b). Results: ``benchmarks/pp_overhead_cpu.md``."""
import json
import os
import statistics
import sys
import time

import torch

from zerotron.testing import run_ranks

VARIANTS = [("1f1b", "prefetch"), ("1f1b", "batched"), ("1f1b", "eager"), ("zb-h1", "prefetch"), ("zb-h1", "batched")]
PAIRS = [(("1f1b", "prefetch"), ("1f1b", "batched")), (("1f1b", "prefetch"), ("1f1b", "eager")),
         (("zb-h1", "prefetch"), ("zb-h1", "batched")), (("zb-h1", "prefetch"), ("1f1b", "prefetch")),
         (("zb-h1", "batched"), ("1f1b", "batched"))]


def _name(v) -> str:
    return f"{v[0]}/{v[1]}"


def work(rounds: int) -> dict:
    import torch.distributed as dist

    from zerotron.config_sections import Config
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.parallel.pipeline.runner import PipelineStrategy

    torch.set_num_threads(1)
    mesh = Mesh(ParallelDims(2, 1, 1, 2), torch.device("cpu"))
    strategies, res = {}, {v: [] for v in VARIANTS}
    for v in VARIANTS:
        cfg = Config()
        cfg.parallel.pp_schedule = v[0]
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0))
        s = strategies[v] = PipelineStrategy(model, mesh, cfg)
        s.executor.p2p.batched, s.executor.p2p.prefetch = v[1] == "batched", v[1] == "prefetch"
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 4096, (2, 128), generator=g), torch.randint(0, 4096, (2, 128), generator=g))
           for _ in range(8)]
    for rnd in range(rounds):
        k = rnd % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            s = strategies[v]
            dist.barrier()
            t0 = time.perf_counter()
            s.zero_grad()
            s.forward_backward(mbs, 2048, "fp32", torch.device("cpu"))
            s.finish_grads()
            dist.barrier()
            wall, tm = time.perf_counter() - t0, s.last_step_timing()
            if rnd:
                res[v].append((wall, tm["busy_s"], tm["idle_s"], tm["post_s"], tm["post_cpu_s"]))
    med = {_name(v): [round(statistics.median(x[i] for x in r) * 1e3, 2) for i in range(5)] for v, r in res.items()}
    ratios = {}
    for a, b in PAIRS:
        rs = [y[0] / x[0] for x, y in zip(res[a], res[b])]
        ratios[f"{_name(a)} vs {_name(b)}"] = {"median": round(statistics.median(rs), 3),
                                               "below_1": sum(r < 1 for r in rs), "n": len(rs)}
    return {"ms_wall_busy_idle_post_postcpu": med, "tokens_per_s_ratio": ratios}


if __name__ == "__main__":
    out = run_ranks(work, 2, int(os.environ.get("ROUNDS", "25")), timeout_s=600)
    for r, o in enumerate(out):
        print("rank", r, json.dumps(o, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"rounds": int(os.environ.get("ROUNDS", "25")), "ranks": out}, f, indent=1)
