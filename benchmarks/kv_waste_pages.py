"""KV waste of the paged cache at 64 concurrent rows, per page size (no timing: the figure depends
only on the lengths and the scheduler, not on the weights or the machine).

Usage: ``python benchmarks/kv_waste_pages.py [--pages 8,16] [--rows 64] [--new 256]
[--workload random|shared-prefix] [--json F]``.

A 1-layer, 16-wide GPT-2 with context 1024 (random weights, greedy, no eos: every row makes
``--new`` tokens), ``--rows`` requests joining at once with prompts of 16..128 random tokens
(seeded; the prompt lengths of ``zerotron bench serve``'s random workload; ``shared-prefix``: its other
workload, one 512-token system prompt + 16 tokens per request), on the default pool
(32 full-context rows) and the default 2048-token step budget. Per engine step: allocated = slots of
the blocks rows reference, filled = slots holding a cached token (each block once,
``ContinuousDecoder.slots_filled``); waste = 1 - sum filled / sum allocated over the steps (what
``zerotron bench serve`` samples from ``/metrics`` over HTTP), and the peak over the steps."""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", default="8,16")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--workload", default="random", choices=("random", "shared-prefix"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed, teardown
    from zerotron.inference import Engine, Request, SamplingParams
    from zerotron.inference.continuous import ContinuousDecoder
    from zerotron.models.registry import build_model, preset_config

    init_distributed("gloo", 300, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(preset_config("tiny", n_layer=1, n_head=2, n_embd=16, block_size=1024, vocab_size=512)).eval()
    eng = Engine(model, Mesh(ParallelDims(1), torch.device("cpu")))
    g = torch.Generator().manual_seed(1)
    if args.workload == "random":
        prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist()
                   for n in torch.randint(16, 129, (args.rows,), generator=g)]
    else:
        system = torch.randint(0, 512, (512,), generator=g).tolist()
        prompts = [system + torch.randint(0, 512, (16,), generator=g).tolist() for _ in range(args.rows)]
    reqs = [Request(p, SamplingParams(max_tokens=args.new, stop_at_eos=False)) for p in prompts]
    rows = []
    for page in (int(p) for p in args.pages.split(",")):
        dec = ContinuousDecoder(eng, page=page)
        alloc = filled = steps = 0
        peak = 0.0
        joins, done = [(i, 0, r) for i, r in enumerate(reqs)], 0
        while done < len(reqs):
            done += len(dec.step(joins, []).finished)
            joins = []
            a, f = dec.blocks_used() * page, dec.slots_filled()
            if a:
                alloc, filled, steps, peak = alloc + a, filled + f, steps + 1, max(peak, 1 - f / a)
        rows.append({"page": page, "workload": args.workload, "rows": args.rows, "new_tokens": args.new, "kv_waste": 1 - filled / alloc,
                     "kv_waste_peak_step": peak, "steps": steps, "preemptions": dec.preemptions})
        print(rows[-1], flush=True)
    teardown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
