"""The paged engine's decode step alone, under the workloads of ``zerotron bench serve`` (issue 31):
where the step's time goes (Python vs torch ops), in one process, one torch thread.

Usage: ``PYTHONPATH=. python benchmarks/serve_engine_profile.py --checkpoint RUN [--rows 16,64]
[--workloads random,shared-prefix] [--new 128] [--profile] [--json F]``.

For each workload and B rows (all joining at step 0, greedy, ``--new`` tokens each; ``random``: prompts of
16..128 random tokens; ``shared-prefix``: one 512-token system prompt + 16 random tokens each), the
checkpoint's model (``zerotron.generate.load_model``) runs ``ContinuousDecoder.step`` until every row ends;
timed: the steps after the first (all prompts prefilled), wall and thread CPU per step and output tokens/s.
``--profile``: a cProfile of the steps (top functions by own time) and a ``torch.profiler`` table of
the torch ops (self CPU time), to tell Python bookkeeping from model compute. ``--shared-prefix
on,off``: each round runs the decoder with shared-prefix attention on and off back to back (order
alternating; :mod:`zerotron.inference.prefix_attention`), checks that the tokens are equal, and
reports the paired ratio of CPU per step. ``--compile on,off``: the same pairing of the compiled decode
forward (``ContinuousDecoder(compile=True)``, :mod:`zerotron.inference.paged_compiled`; compiled once,
before the timed rounds) against the eager one. On a shared machine only the shares (and paired ratios)
mean anything, not the times.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time

import torch

from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed
from zerotron.generate import load_model, resolve_checkpoint
from zerotron.inference import Engine, Request, SamplingParams
from zerotron.inference.continuous import ContinuousDecoder


def prompts(workload: str, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if workload == "random":
        return [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    system = [rng.randrange(1, vocab) for _ in range(512)]
    return [system + [rng.randrange(1, vocab) for _ in range(16)] for _ in range(n)]


def run(eng, reqs, profile: str = "", shared_prefix: bool = True, compile: bool = False) -> dict:
    """Decode ``reqs`` together; the timings of the steps after the first (and a profile text)."""
    dec = ContinuousDecoder(eng, shared_prefix=shared_prefix, compile=compile)
    res = dec.step([(i, 0, r) for i, r in enumerate(reqs)], [])
    done = dict(res.finished)
    prof = cProfile.Profile() if profile == "cprofile" else None
    tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile == "torch" else None
    steps, toks, t0, c0 = 0, 0, time.perf_counter(), time.thread_time()
    if prof:
        prof.enable()
    if tprof:
        tprof.__enter__()
    while len(done) < len(reqs):
        res = dec.step([], [])
        toks += sum(len(t) for t in res.tokens.values())
        done.update(res.finished)
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    text = ""
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        text = s.getvalue()
    if tprof:
        tprof.__exit__(None, None, None)
        text = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return {"steps": steps, "tokens": toks, "prefix_forwards": dec.prefix_forwards, "wall_ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps,
            "tokens_per_s": toks / wall, "profile": text, "out": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--workloads", default="random,shared-prefix")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--shared-prefix", default="on", help="on, off, or on,off (paired)")
    ap.add_argument("--compile", default="off", help="on, off, or on,off (paired; --shared-prefix one mode)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed("gloo", 300, torch.device("cpu"))
    model, tok, _ = load_model(resolve_checkpoint(args.checkpoint), torch.device("cpu"))
    eng = Engine(model.eval(), Mesh(ParallelDims(1), torch.device("cpu")))
    V = model.config.vocab_size
    params = SamplingParams(max_tokens=args.new, stop_at_eos=False)
    run(eng, [Request(p, params) for p in prompts("random", 4, V, 99)])  # warm-up
    cmodes = args.compile.split(",")
    if "on" in cmodes:
        t0 = time.perf_counter()
        run(eng, [Request(p, params) for p in prompts("random", 4, V, 99)], compile=True)
        print(f"compiled warm-up: {time.perf_counter() - t0:.1f} s", flush=True)
    out = []
    for w in args.workloads.split(","):
        for B in (int(x) for x in args.rows.split(",")):
            reqs = [Request(p, params) for p in prompts(w, B, V, B)]
            key = "compile" if len(cmodes) > 1 else "shared_prefix"
            modes = cmodes if len(cmodes) > 1 else args.shared_prefix.split(",")
            for r in range(args.rounds):
                got = {}
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    opts = {"compile": mode == "on"} if key == "compile" else \
                        {"shared_prefix": mode == "on", "compile": cmodes[0] == "on"}
                    rec = run(eng, reqs, **opts)
                    rec.pop("profile")
                    got[mode] = rec.pop("out")
                    print(f"{w} B={B} round {r} {key} {mode}: {rec['wall_ms_per_step']:.2f} ms/step wall, "
                          f"{rec['cpu_ms_per_step']:.2f} CPU, {rec['tokens_per_s']:.0f} tok/s, "
                          f"{rec['prefix_forwards']} prefix forwards", flush=True)
                    out.append({"workload": w, "rows": B, "round": r, key: mode, **rec})
                if len(got) == 2:
                    assert got["on"] == got["off"], f"{key} changed the tokens"
                    on, off = (next(o for o in out[::-1] if o.get(key) == m and o.get("round") == r
                                    and o["workload"] == w and o["rows"] == B) for m in ("on", "off"))
                    print(f"  paired CPU per step on / off: {on['cpu_ms_per_step'] / off['cpu_ms_per_step']:.3f}")
            if args.profile:
                for kind in ("cprofile", "torch"):
                    text = run(eng, reqs, kind)["profile"]
                    print(f"--- {kind}, {w}, B={B}\n{text}", flush=True)
                    out.append({"workload": w, "rows": B, "profile": kind, "text": text})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
