"""Paired before/after of the paged engine's per-step bookkeeping (issue 31), engine alone, one process.

``before``: PagedView as it was at b881491 (every row's slot list built slot by slot in Python,
advanced indexing ``K[gather]`` / ``K[dst] = ...``) and prefix keys rehashed from slot 0 at every
step; ``after``: zerotron's current PagedView (slot arithmetic on a padded block-table tensor,
index_select / index_copy_) and the kept per-row prefix keys. The model: GPT-2 4 layers x 128,
vocab 4096, context 1024, fp32, seeded random weights, one torch thread; B rows of ``--prompt``
random tokens, greedy, ``--new`` tokens each, all joining at step 0. Timed: the decode steps after
every prompt is prefilled (output tokens / s). Each round runs both variants back to back (order
alternating); the two must give identical tokens. Optional ``--profile``: cProfile of 5 decode
steps of the current code at the largest B.

Usage: PYTHONPATH=. python benchmarks/paged_step_before_after.py [--rows 16,64] [--rounds 3] [--json F]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed
from zerotron.inference import Engine, Request, SamplingParams, continuous, continuous_compute
from zerotron.inference.paged import BlockAllocator, PagedView
from zerotron.models.registry import build_model, preset_config


class BeforePagedView(PagedView):
    """The b881491 construction and update (per-slot Python lists, advanced indexing)."""

    def __init__(self, pool, tables, lens, news, device):
        self.pool, p = pool, pool.page
        T = max(news)
        self.S0 = max(n - (T - m) for n, m in zip(lens, news))
        S = self.S0 + T
        self.pad = torch.tensor([self.S0 - n + (T - m) for n, m in zip(lens, news)], dtype=torch.long, device=device)
        src_b, src_t, dst, gather = [], [], [], []
        for b, (tab, n, m) in enumerate(zip(tables, lens, news)):
            slots = [tab[s // p] * p + s % p for s in range(n + m)]
            src_b += [b] * m
            src_t += range(T - m, T)
            dst += slots[n:]
            gather.append([slots[0]] * (S - n - m) + slots)
        self.src = (torch.tensor(src_b, device=device), torch.tensor(src_t, device=device))
        self.dst = torch.tensor(dst, dtype=torch.long, device=device)
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)

    def update(self, layer, k, v):
        pool = self.pool
        if pool.keys[layer] is None:
            n = pool.num_blocks * pool.page
            pool.keys[layer] = k.new_zeros(n, k.size(1), k.size(3))
            pool.values[layer] = v.new_zeros(n, v.size(1), v.size(3))
        K, V = pool.keys[layer], pool.values[layer]
        K[self.dst] = k.transpose(1, 2)[self.src]
        V[self.dst] = v.transpose(1, 2)[self.src]
        return K[self.gather].transpose(1, 2), V[self.gather].transpose(1, 2)


class BeforeAllocator(BlockAllocator):
    """Prefix keys recomputed from slot 0 at every call (the kept keys ignored), on a copy of the sequence."""

    def register(self, table, tokens, start, end, keys=None, base=0):
        super().register(table, tokens[base:], start, end)


def run(eng, B: int, prompt: int, new: int, before: bool, profile: bool = False):
    """(tokens per row, decode output tokens/s, decode steps, profile text)."""
    continuous_compute.PagedView = BeforePagedView if before else PagedView
    continuous.BlockAllocator = BeforeAllocator if before else BlockAllocator
    try:
        g = torch.Generator().manual_seed(B)
        reqs = [Request(torch.randint(0, 4096, (prompt,), generator=g).tolist(),
                        SamplingParams(max_tokens=new, stop_at_eos=False)) for _ in range(B)]
        dec = continuous.ContinuousDecoder(eng, num_blocks=B * -(-(prompt + new) // 16) + 64,
                                           max_step_tokens=B * prompt)
        out = {}
        res = dec.step([(i, 0, r) for i, r in enumerate(reqs)], [])
        out.update(res.finished)
        prof, text = cProfile.Profile() if profile else None, ""
        t0, steps, toks = time.perf_counter(), 0, 0
        while len(out) < B:
            if prof is not None and steps == 2:
                prof.enable()
            res = dec.step([], [])
            if prof is not None and steps == 6:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                text = s.getvalue()
            toks += sum(len(t) for t in res.tokens.values())
            out.update(res.finished)
            steps += 1
        return out, toks / (time.perf_counter() - t0), steps, text
    finally:
        continuous_compute.PagedView, continuous.BlockAllocator = PagedView, BlockAllocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed("gloo", 300, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(preset_config("tiny", n_layer=4, n_head=4, n_embd=128, block_size=1024,
                                      vocab_size=4096)).eval()
    eng = Engine(model, Mesh(ParallelDims(1), torch.device("cpu")))
    rows = [int(x) for x in args.rows.split(",")]
    run(eng, 4, 64, 4, False)  # warm-up
    result = {"rows": {}, "prompt": args.prompt, "new": args.new, "rounds": args.rounds}
    for B in rows:
        tps = {"before": [], "after": []}
        for rnd in range(args.rounds):
            outs = {}
            for name in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                outs[name], t, _, _ = run(eng, B, args.prompt, args.new, name == "before")
                tps[name].append(t)
            assert outs["before"] == outs["after"], "before and after give different tokens"
        ratios = [a / b for a, b in zip(tps["after"], tps["before"])]
        result["rows"][B] = {"before_tok_s": tps["before"], "after_tok_s": tps["after"],
                             "ratio_median": statistics.median(ratios)}
        print(f"B={B}: before {statistics.median(tps['before']):.1f} tok/s, after "
              f"{statistics.median(tps['after']):.1f} tok/s, paired ratio median {statistics.median(ratios):.2f} "
              f"({', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    if args.profile:
        for name in ("before", "after"):
            _, _, _, text = run(eng, max(rows), args.prompt, 12, name == "before", profile=True)
            print(f"--- cProfile, 5 decode steps at B={max(rows)}, {name}\n{text}")
            result[f"profile_{name}"] = text
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
