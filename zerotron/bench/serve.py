"""``zerotron bench serve``: continuous vs window batching under staggered arrivals, paired; with
``--checkpoint DIR``: real servers over HTTP, zerotron vs ``transformers serve``
(:mod:`zerotron.bench.serve_http`).

Usage: ``zerotron bench serve [--nproc N --parallel.tp T --parallel.pp P] [--requests 32]
[--interval-ms 40] [--max-tokens 8,96,24,64] [--window-ms 20] [--max-batch 32] [--rounds 3]
[--json F] [--markdown F]``.

One process by default (``--nproc N``: N ranks, dp x tp x pp as ``zerotron serve`` lays them out,
the window batcher's pipelines with one micro-batch per stage in flight; rank 0 runs the batcher,
the others follow as in ``zerotron serve``), the default config's model (configs/default.toml [model]: 4 layers,
128 wide, block 128, vocab 4096) with seeded random weights, random prompts of 8..32 tokens, greedy,
no eos stop (every request makes its max_tokens). The server's own batchers
(:class:`~zerotron.serve.batching.ContinuousScheduler`, :class:`~zerotron.serve.batching.WindowBatcher`)
run on the main thread as in ``zerotron serve``; a client thread puts request i on the job queue
at ``i x --interval-ms`` (a fixed arrival rate), with max_tokens cycling through ``--max-tokens``
(staggered lengths); no HTTP (what is measured is the batching, not the sockets).

Per request: latency = answer time - arrival time; ttft = first token - arrival. Per run:
output_tokens_per_s = all new tokens / (last answer - first arrival), at most the offered load
(all new tokens / the arrival span) plus the tail; latency mean and p95; ttft mean. Each round runs both modes (the order alternates every round) on the same requests;
``ratio_*`` are medians over rounds of the per-round ratio continuous / window (paired: both
ran under the same load). Outputs of the two modes are compared (they must be equal).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import torch

from zerotron.bench.report import percentile
from zerotron.out_files import check_out_files, write_out_file

__all__ = ["main", "run_mode"]

MODES = ("continuous", "window")


def run_mode(mode: str, engine, requests, interval_s: float, window_ms: float, max_batch: int,
             world: int = 1) -> dict | None:
    """Serve ``requests`` (``zerotron.inference.Request``) arriving every ``interval_s`` with the
    ``mode`` batcher on ``engine``; the run's measurements and outputs (rank 0; the other ranks
    follow and return None)."""
    from zerotron.serve.api import Front, Job
    from zerotron.serve.batching import ContinuousScheduler, WindowBatcher
    from zerotron.serve.follow import Channel, follow

    if world > 1 and torch.distributed.get_rank() != 0:
        follow(engine)
        return None
    front = Front(None, None, "bench", mode)
    ch = Channel(world)
    batcher = (ContinuousScheduler(engine, front, ch, max_batch) if mode == "continuous"
               else WindowBatcher(engine, front, ch, window_ms, max_batch))
    jobs = [Job([r], stream=True) for r in requests]
    arrive, first = [0.0] * len(jobs), [None] * len(jobs)

    def client():
        t0 = time.perf_counter()
        for i, j in enumerate(jobs):
            time.sleep(max(0.0, t0 + i * interval_s - time.perf_counter()))
            arrive[i] = time.perf_counter()
            front.jobs.put(j)
        for j in jobs:
            j.done.wait()
        front.draining.set()

    wakes = [threading.Event() for _ in jobs]
    for j, w in zip(jobs, wakes):  # the batcher calls job.wake after its tokens (Job.token, wake_jobs)
        j.wake = w.set

    def watch(i, j):  # the first token's time (streamed events: a deque the batcher appends to)
        w = wakes[i]
        while True:
            w.clear()  # clear, then look, then wait: a wake after the clear is not lost
            if not j.events:
                w.wait()
                continue
            ev = j.events.popleft()
            if first[i] is None:
                first[i] = time.perf_counter()
            if ev is None:
                return

    threads = [threading.Thread(target=client)] + [threading.Thread(target=watch, args=(i, j)) for i, j in enumerate(jobs)]
    done_at = [0.0] * len(jobs)
    for i, j in enumerate(jobs):  # record the answer time as the job finishes
        j.finish = (lambda f, k: lambda err=None: (done_at.__setitem__(k, time.perf_counter()), f(err)))(j.finish, i)
    for t in threads:
        t.start()
    batcher.run()
    for t in threads:
        t.join()
    lat = [d - a for d, a in zip(done_at, arrive)]
    ttft = [f - a for f, a in zip(first, arrive)]
    toks = sum(len(j.result[0]) for j in jobs)
    return {"mode": mode, "output_tokens_per_s": toks / (max(done_at) - min(arrive)), "latency_mean_s":
            statistics.mean(lat), "latency_p95_s": percentile(lat, 0.95), "ttft_mean_s": statistics.mean(ttft),
            "steps": front.stats.steps, "batches": front.stats.batches, "new_tokens": toks,
            "outputs": [j.result[0] for j in jobs]}


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron bench serve", allow_abbrev=False, formatter_class=HelpFormatter,
                                description="Continuous vs window batching under staggered arrivals, paired. With "
                                "--checkpoint DIR: zerotron serve vs transformers serve over HTTP (options: "
                                "zerotron bench serve --checkpoint DIR --help).")
    p.add_argument("--nproc", type=int, default=1, help="local ranks (dp x tp x pp)")
    p.add_argument("--parallel.tp", dest="tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--parallel.pp", dest="pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--requests", type=int, default=32, help="requests (random prompts of 8..32 tokens)")
    p.add_argument("--interval-ms", type=float, default=40.0, help="one request arrives every this many ms")
    p.add_argument("--max-tokens", default="8,96,24,64", help="max_tokens of request i: item i mod the list")
    p.add_argument("--window-ms", type=float, default=20.0, help="the window batcher's --batch-window-ms")
    p.add_argument("--max-batch", type=int, default=32, help="rows per batch / running together at most")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both modes, order alternating")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", help="write the table here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench serve``; returns an exit code (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in argv):
        from zerotron.bench.serve_http import main as http_main

        return http_main(argv)
    try:
        args = _parser().parse_args(argv)
        check_out_files({"--json": args.json, "--markdown": args.markdown})
        lens = [int(x) if x.strip().isdigit() else -1 for x in args.max_tokens.split(",")]
        if not lens or min(lens) < 1 or max(lens) > 96:
            raise ValueError(f"--max-tokens must be a comma list of integers in 1..96 (prompt + tokens fit the "
                             f"context of 128), got {args.max_tokens!r}")
        if min(args.requests, args.rounds, args.max_batch) < 1 or not args.interval_ms >= 0 or not args.window_ms >= 0:
            raise ValueError("--requests, --rounds, --max-batch must be >= 1, --interval-ms and --window-ms >= 0")
        from zerotron.launch import launch, strip_nproc
        from zerotron.launch_worker import in_worker

        n = int(os.environ["WORLD_SIZE"]) if in_worker() else args.nproc
        if min(n, args.tp, args.pp) < 1 or n % (args.tp * args.pp):
            raise ValueError(f"--nproc {n} must be a multiple of --parallel.tp x --parallel.pp "
                             f"({args.tp} x {args.pp}), all >= 1")

        if args.nproc > 1 and not in_worker():
            return launch(args.nproc, strip_nproc(argv), module="zerotron.bench.serve")
    except SystemExit as e:
        return int(e.code or 0)
    except ValueError as e:
        print(f"zerotron bench serve: error: {e}", file=sys.stderr)
        return 2
    from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed, teardown
    from zerotron.inference import Engine, Request, SamplingParams
    from zerotron.models.registry import build_model, preset_config

    owned = not torch.distributed.is_initialized()
    if owned:
        init_distributed("gloo", 300, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(preset_config("tiny", n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=4096)).eval()
    world = torch.distributed.get_world_size()
    mesh = Mesh(ParallelDims(world, 0, args.tp, args.pp), torch.device("cpu"))
    engine = Engine(model, mesh, microbatches=args.pp)
    g = torch.Generator().manual_seed(1)
    plens = torch.randint(8, 33, (args.requests,), generator=g).tolist()
    reqs = [Request(torch.randint(0, 4096, (n,), generator=g).tolist(),
                    SamplingParams(max_tokens=lens[i % len(lens)], stop_at_eos=False)) for i, n in enumerate(plens)]
    run_mode("continuous", engine, reqs[:2], 0.0, args.window_ms, args.max_batch, world)  # warm-up
    load0 = os.getloadavg()[0]
    records = []
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            rec = run_mode(mode, engine, reqs, args.interval_ms / 1e3, args.window_ms, args.max_batch, world)
            if rec is not None:
                records.append({**rec, "round": r})
    if owned:
        teardown()
    if not records:  # not rank 0
        return 0
    same = all(rec["outputs"] == records[0]["outputs"] for rec in records)
    keys = ("output_tokens_per_s", "latency_mean_s", "latency_p95_s", "ttft_mean_s")
    rows = []
    for mode in MODES:
        rs = [x for x in records if x["mode"] == mode]
        rows.append({"mode": mode, **{k: statistics.median(x[k] for x in rs) for k in keys},
                     **{f"{k}_rounds": [x[k] for x in rs] for k in keys}, "steps": rs[-1]["steps"],
                     "batches": rs[-1]["batches"], "new_tokens": rs[-1]["new_tokens"], "rounds": len(rs),
                     "outputs_equal": same})
    c, w = rows
    for k in keys:
        c[f"ratio_{k}"] = statistics.median(a / b for a, b in zip(c[f"{k}_rounds"], w[f"{k}_rounds"]))
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {world} rank(s) (dp "
               f"{mesh.size('dp')} x tp {args.tp} x pp {args.pp}), "
               f"{torch.get_num_threads()} thread(s), load average {load0:.1f} at start / {os.getloadavg()[0]:.1f} at end")
    table = ["| batching | output tokens/s | latency mean (s) | latency p95 (s) | TTFT mean (s) | decode iterations "
             "| batches |", "|---|---|---|---|---|---|---|"]
    for x in rows:
        table.append(f"| {x['mode']} | {x['output_tokens_per_s']:.0f} | {x['latency_mean_s']:.3f} | "
                     f"{x['latency_p95_s']:.3f} | {x['ttft_mean_s']:.3f} | {x['steps'] or '-'} | {x['batches']} |")
    ratios = ", ".join(f"{k} {c['ratio_' + k]:.2f}" for k in keys)
    span = (args.requests - 1) * args.interval_ms / 1e3
    offered = c["new_tokens"] / span if span > 0 else float("inf")
    for x in rows:
        x["offered_tokens_per_s"] = offered
    text = (f"{machine}; {args.requests} requests, one every {args.interval_ms:g} ms, max_tokens cycling "
            f"{args.max_tokens} ({c['new_tokens']} new tokens: an offered load of {offered:.0f} tokens/s, the most either "
            f"mode can reach while requests arrive); window {args.window_ms:g} ms, max batch {args.max_batch}; {args.rounds} rounds "
            f"(medians); outputs equal across modes: {same}\n\n" + "\n".join(table) +
            f"\n\ncontinuous / window (median of per-round ratios): {ratios}\n")
    print(f"zerotron bench serve: {text}")
    if args.json:
        write_out_file(args.json, json.dumps([{**x, "machine": machine} for x in rows], indent=1))
    if args.markdown:
        cmd = " ".join(["zerotron bench serve", *[f"--nproc {world}"] * (world > 1), *strip_nproc(argv)])
        write_out_file(args.markdown, f"# zerotron bench serve\n\n`{cmd}`\n\n{text}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
