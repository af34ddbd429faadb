"""``zerotron bench paged``: what the paged KV cache's features buy, in one process, paired.

Usage: ``zerotron bench paged [--rounds 3] [--json F]``.

The default config's model shape (4 layers, 128 wide, vocab 4096, context ``--context`` tokens)
with seeded random weights, greedy, no eos; :class:`~zerotron.inference.continuous.ContinuousDecoder`
driven directly (no HTTP: what is measured is the engine). Four workloads, each round running both
variants back to back (order alternating) so the ratios are paired:

* ``speculative``: one request (batch 1) whose prompt repeats a 12-token phrase, 96 new tokens;
  plain decoding vs prompt lookup with 4 proposed tokens: output tokens/s ratio and the acceptance
  rate (on repetitive text the proposals are often right);
* ``prefix``: 8 requests one after the other, each a shared ``--shared`` token system prompt plus
  8 tokens of its own, 4 new tokens; the mean time to first token of requests 2..8 with the prefix
  cache vs without (their shared blocks are found cached);
* ``preemption``: 16 concurrent requests of 64 new tokens on a pool of a quarter of the blocks
  they need at the end: every request completes; preemptions, recomputed tokens and the most
  steps a request waited for its first token;
* ``kv_waste``: the same 16 requests on a pool large enough: 1 - (slots holding a cached token /
  slots of the blocks in use), averaged over the steps (the paged cache wastes at most one
  partly filled block per row).

Timings on a shared CPU are only comparable within a round (see the paired ratios)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from zerotron.out_files import check_out_files, write_out_file

__all__ = ["main"]


def _steps(dec, joins_at: dict, reqs) -> tuple[dict, dict, int, float]:
    """Drive ``dec``; ({request: new tokens}, {request: steps it waited for its first token},
    steps, wall s); ``dec.waste``: the mean KV waste over the steps."""
    out, first, t_in, step = {}, {}, {}, 0
    t0 = time.perf_counter()
    waste = []
    while len(out) < len(reqs):
        joins = [(i, 0, reqs[i]) for i in joins_at.get(step, [])]
        for i, _, _ in joins:
            t_in[i] = step
        res = dec.step(joins, [])
        for rid in res.tokens:
            first.setdefault(rid, step - t_in[rid])
        out.update(res.finished)
        used = dec.blocks_used() * dec.page
        if used:
            waste.append(1 - sum(r.cached for r in dec.rows.values()) / used)
        step += 1
    dec.waste = statistics.mean(waste) if waste else 0.0
    return out, first, step, time.perf_counter() - t0


def _sequential(dec, reqs) -> tuple[dict, dict]:
    out, first = {}, {}
    for i, r in enumerate(reqs):
        t = time.perf_counter()
        res = dec.step([(i, 0, r)], [])
        first[i] = time.perf_counter() - t
        out.update(res.finished)
        while i not in out:
            out.update(dec.step([], []).finished)
    return out, first


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench paged``; returns an exit code (2 for bad arguments)."""
    p = argparse.ArgumentParser(prog="zerotron bench paged", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="paired rounds")
    p.add_argument("--context", type=int, default=1024, help="the model's block_size")
    p.add_argument("--shared", type=int, default=512, help="tokens of the shared system prompt (prefix workload)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_out_files({"--json": args.json})
    except ValueError as e:
        print(f"zerotron bench paged: error: {e}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.shared < 1 or args.context < args.shared + 16 or args.context < 160:
        print("zerotron bench paged: error: need --rounds >= 1 and --context >= max(160, --shared + 16)",
              file=sys.stderr)
        return 2
    from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed, teardown
    from zerotron.inference import Engine, Request, SamplingParams
    from zerotron.inference.continuous import ContinuousDecoder
    from zerotron.models.registry import build_model, preset_config

    owned = not torch.distributed.is_initialized()
    if owned:
        init_distributed("gloo", 300, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(preset_config("tiny", n_layer=4, n_head=4, n_embd=128, block_size=args.context,
                                      vocab_size=4096)).eval()
    eng = Engine(model, Mesh(ParallelDims(1), torch.device("cpu")))
    g = torch.Generator().manual_seed(1)
    sp = lambda n: SamplingParams(max_tokens=n, stop_at_eos=False)  # noqa: E731
    phrase = torch.randint(0, 4096, (12,), generator=g).tolist()
    rep = [Request(phrase * 8, sp(96))]
    system = torch.randint(0, 4096, (args.shared,), generator=g).tolist()
    shared = [Request(system + torch.randint(0, 4096, (8,), generator=g).tolist(), sp(4)) for _ in range(8)]
    many = [Request(torch.randint(0, 4096, (int(n),), generator=g).tolist(), sp(64))
            for n in torch.randint(8, 64, (16,), generator=g)]
    need = sum(-(-(len(r.prompt) + 64) // 16) for r in many)
    row_blocks = -(-args.context // 16)  # one full-context row (the pool is zeroed when first used: keep it small)
    res = {"spec_ratio": [], "acceptance": [], "prefix_ttft_ratio": [], "kv_waste": [], "preemptions": [],
           "recomputed_tokens": [], "max_wait_steps": [], "completed": []}
    _steps(ContinuousDecoder(eng, num_blocks=row_blocks, speculative=4), {0: [0]}, rep)  # warm-up
    for rnd in range(args.rounds):
        order = (0, 1) if rnd % 2 == 0 else (1, 0)
        tps = {}
        for k in order:
            dec = ContinuousDecoder(eng, num_blocks=row_blocks, speculative=4 * k)
            out, _, _, wall = _steps(dec, {0: [0]}, rep)
            tps[k] = len(out[0]) / wall
            if k:
                res["acceptance"].append(dec.accepted / max(dec.proposed, 1))
                spec_out = out[0]
            else:
                plain_out = out[0]
        assert spec_out == plain_out, "speculative greedy output differs from plain"
        res["spec_ratio"].append(tps[1] / tps[0])
        ttft = {}
        for k in order:
            _, first = _sequential(ContinuousDecoder(eng, num_blocks=2 * row_blocks, prefix_caching=bool(k)), shared)
            ttft[k] = statistics.mean(first[i] for i in range(1, 8))
        res["prefix_ttft_ratio"].append(ttft[1] / ttft[0])
        small = ContinuousDecoder(eng, num_blocks=max(need // 4, row_blocks))
        out, waits, _, _ = _steps(small, {0: list(range(16))}, many)
        res["completed"].append(len(out))
        res["preemptions"].append(small.preemptions)
        res["recomputed_tokens"].append(small.recomputed_tokens)
        big = ContinuousDecoder(eng, num_blocks=need + 16)
        _steps(big, {0: list(range(16))}, many)
        res["kv_waste"].append(big.waste)
        res["max_wait_steps"].append(max(waits.values()))
    summary = {k: statistics.median(v) for k, v in res.items()}
    summary["rounds"] = args.rounds
    for k, v in summary.items():
        print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
    if args.json:
        write_out_file(args.json, json.dumps({"summary": summary, "rounds": res}, indent=1))
    if owned:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
