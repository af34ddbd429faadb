"""Where ``zerotron serve``'s CPU goes under C concurrent streaming clients (issue 31), and what a
token costs it against ``transformers serve``.

Usage: ``python benchmarks/serve_profile.py --checkpoint RUN [--concurrency 64] [--workload random|shared-prefix]
[--max-tokens 128] [--servers zerotron,transformers] [--profile] [--out DIR] [--serve-args "..."] [--tree DIR]``.

For each server in turn (``zerotron serve`` of ``--tree``, default this one, in a process with hooks;
``transformers serve --continuous-batching`` on the checkpoint's export, started as ``zerotron bench
serve`` starts it), one torch thread each: C clients as ``zerotron bench serve`` runs them (the
official ``openai`` client, streamed completions, greedy, the same prompts for every server;
``zerotron.bench.http_clients.run_clients``). Measured over the run (not the start-up): the CPU
seconds of every server thread by name (``/proc/PID/task``; zerotron's "main" is the batcher, which
runs the engine, "zerotron-http" uvicorn/FastAPI and the streamed events) and of the client
process, each per output token; for zerotron also the wall and CPU time inside
``ContinuousDecoder.step`` (the engine step, scheduling included) per token; ``--profile``: a
cProfile of zerotron's batcher and HTTP threads (``batcher.prof``, ``http.prof`` in DIR; the profiler
slows Python down, so read its shares, not its times). Writes ``DIR/serve_profile.json``.

CPU seconds per token move much less with the load of a shared machine than wall time (cache and
frequency effects remain); when every core is busy, throughput is bounded by what each token costs
the server and the clients together."""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of a task: ``/proc/.../schedstat``."""
    f = Path(path).read_text().split()
    return int(f[0]) / 1e9, int(f[1]) / 1e9


def serve(out: str, profile: bool, argv: list[str]) -> int:
    """The server process: ``zerotron serve argv`` with the measuring hooks; results in ``out``
    (``server.json`` at the end; ``snap.json`` on each SIGUSR1: the figures so far, for a window)."""
    import cProfile
    import signal
    import threading

    import uvicorn

    from zerotron.inference import continuous
    from zerotron.serve import batching, command

    figures = {"step_wall_s": 0.0, "step_cpu_s": 0.0, "steps": 0, "step_runq_s": 0.0, "idle_s": 0.0, "snap": 0}

    def snapshot(*_):
        figures["snap"] += 1
        Path(out, "snap.tmp").write_text(json.dumps({**figures, "t": time.perf_counter()}))
        os.replace(Path(out, "snap.tmp"), Path(out, "snap.json"))

    signal.signal(signal.SIGUSR1, snapshot)

    def measured(name, fn):
        def run(*a, **k):
            pr = cProfile.Profile() if profile else None
            t0 = time.thread_time()
            if pr:
                pr.enable()
            try:
                return fn(*a, **k)
            finally:
                if pr:
                    pr.disable()
                    pr.dump_stats(f"{out}/{name}.prof")
                figures[f"{name}_cpu_s"] = time.thread_time() - t0
        return run

    step = continuous.ContinuousDecoder.step

    def timed_step(self, *a, **k):
        me = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        (c, q), t = _schedstat(me), time.perf_counter()
        try:
            return step(self, *a, **k)
        finally:
            c1, q1 = _schedstat(me)
            figures["step_wall_s"] += time.perf_counter() - t
            figures["step_cpu_s"] += c1 - c
            figures["step_runq_s"] += q1 - q
            figures["steps"] += 1

    take = batching.ContinuousScheduler._take

    def timed_take(self, block):  # the batcher waiting for work (nothing running): idle, not GIL
        t = time.perf_counter()
        try:
            return take(self, block)
        finally:
            if block:
                figures["idle_s"] += time.perf_counter() - t

    continuous.ContinuousDecoder.step = timed_step
    batching.ContinuousScheduler._take = timed_take
    batching.ContinuousScheduler.run = measured("batcher", batching.ContinuousScheduler.run)
    uvicorn.Server.run = measured("http", uvicorn.Server.run)
    code = command.main(argv)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    figures["process_cpu_s"] = ru.ru_utime + ru.ru_stime
    Path(out, "server.json").write_text(json.dumps(figures))
    return code


def _stat(path: str) -> list[str]:
    stat = Path(path).read_text()
    return stat[stat.rindex(")") + 2:].split()  # fields from "state" on: ppid [1], utime [11], stime [12]


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of process ``pid``: per live thread by name (``/proc/PID/task``;
    threads of one name summed; the main thread is "main"), "process" (every thread, ended ones
    included) and "children" (its live child processes, whole)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            f = _stat(f"/proc/{pid}/task/{tid}/stat")
            name = "main" if tid == str(pid) else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / tick
    f = _stat(f"/proc/{pid}/stat")
    out["process"] = (int(f[11]) + int(f[12])) / tick
    out["children"] = 0.0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = _stat(f"/proc/{d}/stat")
            except OSError:
                continue
            if f[1] == str(pid):
                out["children"] += (int(f[11]) + int(f[12])) / tick
    return out


def threads_sched(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread of ``pid`` and of its child processes ("child/NAME"), by name (summed): (seconds
    on a CPU, seconds waiting for one), from ``schedstat``; the main thread is "main"."""
    out: dict[str, tuple[float, float]] = {}
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if _stat(f"/proc/{d}/stat")[1] == str(pid):
                    kids.append(int(d))
            except OSError:
                continue
    for proc, prefix in [(pid, "")] + [(k, "child/") for k in kids]:
        for tid in os.listdir(f"/proc/{proc}/task"):
            try:
                name = "main" if tid == str(proc) else Path(f"/proc/{proc}/task/{tid}/comm").read_text().strip()
                c, q = _schedstat(f"/proc/{proc}/task/{tid}/schedstat")
            except OSError:
                continue
            a, b = out.get(prefix + name, (0.0, 0.0))
            out[prefix + name] = (a + c, b + q)
    return out


def snap(srv, out: str, timeout_s: float = 30) -> dict:
    """The measuring server's figures now (SIGUSR1: it writes ``snap.json``)."""
    f = Path(out, "snap.json")
    seq = json.loads(f.read_text())["snap"] if f.exists() else 0
    os.kill(srv.proc.pid, __import__("signal").SIGUSR1)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            d = json.loads(f.read_text())
            if d["snap"] > seq:
                return d
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise RuntimeError("the server wrote no snapshot")


def wall_split(s0: dict, s1: dict, q0: dict, q1: dict) -> dict:
    """Where the batcher thread's wall time went between snapshots ``s0``/``s1`` (schedstat
    ``q0``/``q1``): on a CPU, waiting for a CPU (run queue), idle (waiting for work), and the
    rest -- blocked while it had work, i.e. waiting for the GIL (the engine does no other
    blocking I/O in one process) -- as fractions of the wall; the same inside engine steps; and
    each other thread's CPU and run-queue seconds as fractions of that wall."""
    wall = s1["t"] - s0["t"]
    cpu, runq = (q1["main"][i] - q0["main"][i] for i in (0, 1))
    idle = s1["idle_s"] - s0["idle_s"]
    sw, sc, sq = (s1[k] - s0[k] for k in ("step_wall_s", "step_cpu_s", "step_runq_s"))
    r = lambda x: round(x / wall, 4)  # noqa: E731
    return {"wall_s": round(wall, 3), "batcher": {"cpu": r(cpu), "runq": r(runq), "idle": r(idle),
                                                  "blocked_gil": r(wall - cpu - runq - idle)},
            "in_step": {"wall": r(sw), "cpu": r(sc), "runq": r(sq), "blocked_gil": r(sw - sc - sq),
                        "steps": s1["steps"] - s0["steps"]},
            "threads": {n: {"cpu": r(q1[n][0] - q0.get(n, (0, 0))[0]), "runq": r(q1[n][1] - q0.get(n, (0, 0))[1])}
                        for n in q1 if q1[n][0] - q0.get(n, (0, 0))[0] > 0.001 * wall}}


def start(kind: str, args, out: str):
    """Start the server ``kind`` (zerotron: this script's measuring server on ``args.tree``;
    transformers: ``transformers serve --continuous-batching`` on the checkpoint's export, as
    ``zerotron bench serve`` starts it) and wait until it answers."""
    from zerotron.bench import http_servers as hs
    from zerotron.bench import serve_http as sh

    if kind == "transformers":
        hf = str(Path(out) / "hf")
        if not Path(hf, "tokenizer.json").exists():
            import subprocess

            subprocess.run([sys.executable, "-m", "zerotron", "export", "--checkpoint", args.checkpoint, "--out", hf],
                           check=True, stdout=subprocess.DEVNULL)
        return hs.start_server("transformers", args.checkpoint, hf, 1, args.concurrency, shlex.split(sh.PEER_ARGS))
    argv = ["--checkpoint", args.checkpoint, "--port", "0", "--max-batch", str(args.concurrency), "--model-name",
            "bench", *shlex.split(args.serve_args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(args.tree).resolve()), "SERVE_PROFILE_ARGV": json.dumps(argv)}
    cmd = [sys.executable, __file__, "--checkpoint", args.checkpoint, "--server", out,
           *(["--profile"] if args.profile else [])]
    srv = hs.Server("zerotron", cmd, env, "bench")
    deadline = time.time() + 300
    while not (srv.base and hs.ready(srv.base)):
        if m := re.search(r"listening on (http://\S+)", srv.output()):
            srv.base = m.group(1)
        if srv.proc.poll() is not None or time.time() > deadline:
            srv.stop()
            raise RuntimeError(srv.output())
        time.sleep(0.3)
    return srv


def measure(kind: str, args, out: str, prompts: list[str], warm: list[str]) -> dict:
    """One run of ``kind`` under the clients; the figures (see the module docstring)."""
    from zerotron.bench import http_clients as hc

    srv = start(kind, args, out)
    try:
        hc.run_clients(srv, [warm], 4)
        k = args.requests_per_client
        load0 = os.getloadavg()[0]
        z = kind == "zerotron"
        s0, q0 = (snap(srv, out), threads_sched(srv.proc.pid)) if z else (None, None)
        ru0, th0 = resource.getrusage(resource.RUSAGE_SELF), threads_cpu(srv.proc.pid)
        row = hc.run_clients(srv, [prompts[i * k:(i + 1) * k] for i in range(args.concurrency)], args.max_tokens)
        ru1, th1 = resource.getrusage(resource.RUSAGE_SELF), threads_cpu(srv.proc.pid)
        s1, q1 = (snap(srv, out), threads_sched(srv.proc.pid)) if z else (None, None)
    finally:
        srv.stop()
    n = row["output_tokens"]
    res = {"server": kind, "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
           **{x: row[x] for x in ("output_tokens_per_s", "tpot_p50_s", "ttft_p50_s", "kv_waste", "completed",
                                  "failed", "wall_s")},
           "client_cpu_ms_per_token": 1e3 * ((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / n,
           "server_cpu_ms_per_token": {t: round(1e3 * (th1.get(t, 0) - th0.get(t, 0)) / n, 4) for t in th1
                                       if th1.get(t, 0) - th0.get(t, 0) > 0}}
    if kind == "zerotron":
        server = json.loads(Path(out, "server.json").read_text())
        res["wall_split"] = wall_split(s0, s1, q0, q1)
        res["engine_step"] = {"steps": server["steps"], "wall_ms_per_token": 1e3 * server["step_wall_s"] / n,
                              "cpu_ms_per_token": 1e3 * server["step_cpu_s"] / n}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workload", default="random", choices=("random", "shared-prefix"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--serve-args", default="")
    p.add_argument("--servers", default="zerotron", help="comma list of zerotron, transformers: run one after the "
                   "other, each with the same prompts")
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tree", default=str(ROOT), help="the source tree whose zerotron the server runs (a before/after "
                   "pair: the same script on two trees)")
    p.add_argument("--server", default=None, help=argparse.SUPPRESS)  # internal: run as the server process
    args = p.parse_args()
    if args.server:
        torch_threads()
        return serve(args.server, args.profile, json.loads(os.environ["SERVE_PROFILE_ARGV"]))
    from tokenizers import Tokenizer

    from zerotron.bench import http_clients as hc

    out = args.out or tempfile.mkdtemp(prefix="serve_profile.")
    Path(out).mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(next(Path(args.checkpoint).rglob("tokenizer.json"))))
    prompts = hc.make_prompts(tok, args.workload, args.concurrency * args.requests_per_client, 16, 128, 512, args.seed)
    warm = hc.make_prompts(tok, "random", 1, 16, 128, 512, args.seed - 1)
    rows = [measure(kind, args, out, prompts, warm) for kind in args.servers.split(",")]
    res = {"tree": args.tree, "checkpoint": args.checkpoint, "concurrency": args.concurrency,
           "workload": args.workload, "max_tokens": args.max_tokens, "serve_args": args.serve_args,
           "profiled": args.profile, "rows": rows}
    Path(out, "serve_profile.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"written to {out}")
    return 0


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


if __name__ == "__main__":
    sys.exit(main())
