"""Where one engine iteration of ``zerotron serve`` goes at B decoding rows (issue 31): the
batcher's loop as the server runs it, in one process, CPU seconds of the batcher thread per part.

Usage: ``PYTHONPATH=. python benchmarks/serve_step_breakdown.py --checkpoint RUN [--rows 16] [--new 128]
[--compile on|off] [--rounds 3] [--tree OLD_TREE] [--torch-profile] [--json F]``.

The loop is the real one: :class:`~zerotron.serve.batching.ContinuousScheduler` over a
:class:`~zerotron.serve.link.RemoteFront` whose other end is a child process that reads the step
messages (as the HTTP front-end process does; it unpickles them and counts tokens). B requests
(random prompts of 16..128 tokens, greedy, ``--new`` tokens each, no eos stop) arrive before the
first iteration; timed: the iterations in which every row decodes (all prompts prefilled, none
ended yet). Each part's batcher-thread CPU (``time.thread_time``, inclusive of the parts inside
it) is accumulated by wrappers around the methods named in the table; "rest" is the parent less
its parts. ``--torch-profile``: a ``torch.profiler`` table of the timed iterations (self CPU per
op; the compiled graph's guards show as "TorchDynamo Cache Lookup").

``--tree OLD_TREE``: each round runs OLD_TREE's code and this tree's in two fresh child processes
one after the other (order alternating), the tokens checked equal, and the paired ratio
new / old of CPU per iteration is reported: on a shared machine only such paired ratios mean
anything, not the times. A part that a tree does not have is reported as absent."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (label, module, class or None, attribute): wrapped in this order; a missing one is skipped
PARTS = [
    ("loop", None, None, None),  # one batcher iteration (publish end to publish end)
    ("pump (poll the front end)", "zerotron.serve.link", "RemoteFront", "pump"),
    ("step", "zerotron.inference.continuous", "ContinuousDecoder", "step"),
    ("step/_schedule", "zerotron.inference.continuous", "ContinuousDecoder", "_schedule"),
    ("step/_decode", "zerotron.inference.continuous", "ContinuousDecoder", "_decode"),
    ("step/_decode/PagedView", "zerotron.inference.paged", "PagedView", "__init__"),
    ("step/_decode/compiled call", "zerotron.inference.paged_compiled", "CompiledPagedDecode", "__call__"),
    ("step/_decode/compiled call/graph (guards + kernels)", None, None, "fn"),
    ("step/_decode/eager forward", "zerotron.inference.continuous", "ContinuousDecoder", "_forward"),
    ("step/_decode/_sample", "zerotron.inference.continuous", "ContinuousDecoder", "_sample"),
    ("step/_advance", "zerotron.inference.continuous", "ContinuousDecoder", "_advance"),
    ("step/_ends", "zerotron.inference.continuous", "ContinuousDecoder", "_ends"),
    ("step/_leave", "zerotron.inference.continuous", "ContinuousDecoder", "_leave"),
    ("hand-off (job.token)", "zerotron.serve.link", "RemoteJob", "token"),
    ("_account (/metrics figures)", "zerotron.serve.batching", "ContinuousScheduler", "_account"),
    ("publish (pickle + send)", "zerotron.serve.link", "RemoteFront", "publish"),
]


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]


def _sink(conn, out_q) -> None:
    """The front end's stand-in: read the step messages until "stop"; report tokens and CPU."""
    import resource

    toks = 0
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "stop":
            break
        if msg[0] == "step":
            toks += sum(len(p) for _, p in msg[1])
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out_q.put({"tokens": toks, "cpu_s": ru.ru_utime + ru.ru_stime})


def measure(args) -> dict:
    """One run of the loop in this process (this tree's or the --tree's code on sys.path)."""
    import importlib
    import multiprocessing as mp
    import threading

    import torch

    torch.set_num_threads(1)
    from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed
    from zerotron.generate import load_model, resolve_checkpoint
    from zerotron.inference import Engine, Request, SamplingParams
    from zerotron.serve import batching, link
    from zerotron.serve.follow import Channel

    init_distributed("gloo", 300, torch.device("cpu"))
    model, _, _ = load_model(resolve_checkpoint(args.checkpoint), torch.device("cpu"))
    eng = Engine(model.eval(), Mesh(ParallelDims(1), torch.device("cpu")))
    compiled = args.compile == "on"
    if compiled and args.cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache

    acc: dict[str, float] = {}
    calls: dict[str, int] = {}
    state = {"timed": False, "steps": 0, "rows_decoding": 0, "last": None}
    clock = time.thread_time

    def wrap(label, fn):
        def inner(*a, **k):
            if not state["timed"]:
                return fn(*a, **k)
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + clock() - t0
                calls[label] = calls.get(label, 0) + 1
        inner.__wrapped__ = fn
        return inner

    present = []
    for label, mod, cls, attr in PARTS:
        if mod is None:
            continue
        try:
            owner = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
        if not hasattr(owner, attr):
            continue
        setattr(owner, attr, wrap(label, getattr(owner, attr)))
        present.append(label)

    parent, child = mp.Pipe()
    out_q = mp.get_context("fork").SimpleQueue()
    proc = mp.get_context("fork").Process(target=_sink, args=(child, out_q), daemon=True)
    proc.start()

    class _Link:  # what RemoteFront needs of a FrontendLink
        conn = parent

    stop = threading.Event()
    front = link.RemoteFront(_Link(), stop)
    V = model.config.vocab_size
    params = SamplingParams(max_tokens=args.new, stop_at_eos=False)
    paged = {"compile": compiled} if compiled else {}
    sched = batching.ContinuousScheduler(eng, front, Channel(1), max(args.rows, 1), paged)
    if compiled:
        fn = sched.decoder.compiled.fn
        sched.decoder.compiled.fn = wrap("step/_decode/compiled call/graph (guards + kernels)", fn)
        present.append("step/_decode/compiled call/graph (guards + kernels)")

    def warm(n_rows, new, seed):  # a short run (compiles the eager paths' first calls, the graph's sizes)
        jobs = [link.RemoteJob(front, 10_000 + i, [Request(p, SamplingParams(max_tokens=new, stop_at_eos=False))])
                for i, p in enumerate(prompts(n_rows, V, seed))]
        return jobs

    out_tokens: dict[int, list[int]] = {}
    jobs = warm(4, 8, 99)
    jobs += [link.RemoteJob(front, i, [Request(p, params)]) for i, p in enumerate(prompts(args.rows, V, args.seed))]
    for j in jobs[:4]:
        front.open[j.jid] = j
        front.jobs.arrived.append(j)
    left = {"n": args.rows, "warm": 4}
    real = jobs[4:]

    orig_publish = link.RemoteFront.publish  # wrapped (or not) above; the loop boundary and the run's end

    tprof = None
    if args.torch_profile:
        tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def publish(self, jobs_):
        orig_publish(self, jobs_)
        now = clock()
        if state["timed"] and state["last"] is not None:
            acc["loop"] = acc.get("loop", 0.0) + now - state["last"]
            calls["loop"] = calls.get("loop", 0) + 1
        state["last"] = now
        d = sched.decoder
        if left["warm"]:
            left["warm"] = sum(1 for j in jobs[:4] if j.jid in front.open)
            if not left["warm"]:  # the warm-up ended: the timed requests arrive
                for j in real:
                    front.open[j.jid] = j
                    front.jobs.arrived.append(j)
            return
        for j in real:
            if j.result[0] is not None and j.jid not in out_tokens:
                out_tokens[j.jid] = list(j.result[0])
        decoding = len(d.rows) == args.rows and all(r.cached == len(r.tokens) - r.base - 1 + 0 for r in d.rows.values()) \
            and all(len(r.new) >= 2 for r in d.rows.values()) and all(len(r.new) < args.new - 1 for r in d.rows.values())
        if decoding and not state["timed"]:
            state["timed"] = True
            state["t0"] = time.perf_counter()
            if tprof is not None:
                tprof.__enter__()
        elif not decoding and state["timed"]:
            state["timed"] = False
            state["wall"] = time.perf_counter() - state["t0"]
            if tprof is not None:
                tprof.__exit__(None, None, None)
        if state["timed"]:
            state["steps"] += 1
        if len(out_tokens) == args.rows:
            front.draining.set()

    link.RemoteFront.publish = publish
    sched.run()
    parent.send(("stop",))
    sink = out_q.get()
    proc.join(10)
    n = max(calls.get("loop", 0), 1)
    rows = [{"part": label, "ms_per_iteration": 1e3 * acc.get(label, 0.0) / n,
             "calls_per_iteration": calls.get(label, 0) / n} for label, *_ in PARTS if label in acc]
    res = {"tree": str(Path(sys.modules["zerotron"].__file__).parents[1]), "compile": args.compile,
           "rows": args.rows, "iterations": calls.get("loop", 0), "cpu_ms_per_iteration": 1e3 * acc.get("loop", 0) / n,
           "wall_ms_per_iteration": 1e3 * state.get("wall", 0.0) / n, "parts": rows,
           "absent": [label for label, *_ in PARTS[1:] if label not in present],
           "sink_cpu_s": sink["cpu_s"], "sink_tokens": sink["tokens"],
           "tokens": {str(k): v for k, v in sorted(out_tokens.items())}}
    if tprof is not None:
        res["torch_profile"] = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return res


def _child(tree: str, args, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--checkpoint", args.checkpoint, "--rows", str(args.rows),
           "--new", str(args.new), "--compile", args.compile, "--seed", str(args.seed), "--child-out", path, *extra]
    if args.cache:
        cmd += ["--cache", args.cache]
    subprocess.run(cmd, env=env, check=True, cwd=tree)
    out = json.loads(Path(path).read_text())
    os.unlink(path)
    return out


def _print(res: dict) -> None:
    print(f"{res['tree']} compile={res['compile']} rows={res['rows']}: {res['iterations']} iterations, "
          f"{res['cpu_ms_per_iteration']:.3f} ms CPU / {res['wall_ms_per_iteration']:.3f} ms wall per iteration; "
          f"front-end stand-in {res['sink_cpu_s']:.2f} CPU s")
    for r in res["parts"]:
        print(f"  {r['part']:<58} {r['ms_per_iteration']:7.3f} ms  x{r['calls_per_iteration']:.1f}")
    if res["absent"]:
        print("  absent in this tree:", ", ".join(res["absent"]))
    if res.get("torch_profile"):
        print(res["torch_profile"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--compile", default="on", choices=("on", "off"))
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tree", default=None, help="an older tree to pair against this one")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--cache", default=None, help="TORCHINDUCTOR_CACHE_DIR for the compiled runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_out:
        Path(args.child_out).write_text(json.dumps(measure(args)))
        return
    extra = ["--torch-profile"] if args.torch_profile else []
    trees = [("new", str(ROOT))] + ([("old", str(Path(args.tree).resolve()))] if args.tree else [])
    out = []
    for r in range(args.rounds):
        got = {}
        for name, tree in (trees if r % 2 == 0 else trees[::-1]):
            res = _child(tree, args, extra)
            res["round"], res["which"] = r, name
            got[name] = res
            _print(res)
            out.append({k: v for k, v in res.items() if k != "tokens"})
        if len(got) == 2:
            assert got["new"]["tokens"] == got["old"]["tokens"], "the trees decoded different tokens"
            ratio = got["new"]["cpu_ms_per_iteration"] / got["old"]["cpu_ms_per_iteration"]
            print(f"round {r}: new / old CPU per iteration {ratio:.3f} (tokens equal)", flush=True)
            out.append({"round": r, "ratio_cpu_per_iteration": ratio})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
