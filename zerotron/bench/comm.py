"""``zerotron bench comm``: time every collective zerotron uses, nccl-tests style.

Usage: ``zerotron bench comm --nproc N [--ops all_reduce,...,p2p] [--sizes 4KiB:16MiB] [--iters K]
[--warmup W] [--json F] [--plot F.png] [--backend auto|gloo|nccl]`` (also ``python -m
zerotron.bench.comm ...``). With ``--nproc > 1`` outside a worker the command re-runs itself in N
local workers (:func:`zerotron.launch.launch`).

Method. Every call goes through :mod:`zerotron.distributed.comm` on flat contiguous float32
tensors. Each op is first checked once for correct values (on <= 64KiB), then every size is
timed nccl-tests style: ``warmup`` calls, then 3 loops of ``iters // 3`` back-to-back calls (a
barrier before each loop, ``torch.cuda.synchronize`` around it on CUDA), time per call = loop time
/ calls, the median over loops; the reported time is the max over ranks. Back-to-back calls
include the per-call latency a training step pays (a barrier before every call would hide it). "bytes" is the nccl-tests size: all_reduce/broadcast/p2p the tensor, all_gather
the output, reduce_scatter and all_to_all the input. algbw = bytes / time and busbw = algbw x
``busbw_factor(op, n)`` (NVIDIA nccl-tests, doc/PERFORMANCE.md), in GB/s with GB = 1e9 bytes.
Sizes are rounded down to a multiple of 4*n bytes so every rank's shard is a whole float32 count.
p2p is a ring: rank r sends to (r+1)%n and receives from (r-1)%n in one batch_isend_irecv.
"nonblocking" all_reduce issues K async all-reduces then waits for all; its time is total / K.
"after_compute" all_reduce: the time a blocking all-reduce adds when each call follows a ~1 ms
matmul (as tensor parallelism issues them): time per (matmul, all-reduce) pair - time per matmul
(on CPU the communication threads must first win a core back from the computing ones); clipped
at 0.1 us.
Noise warning: for every blocking and nonblocking timing each rank keeps its per-loop times (time
per call in each of the 3 loops); a timing is *noisy* when, on some rank, max/min of those times >
``NOISE_MAX_MIN`` (2) or their coefficient of variation (population stdev / mean) >
``NOISE_CV`` (0.5). Each result records the worst rank's ``loop_spread`` (max/min) and
``loop_cv``, and rank 0 prints one warning line per noisy (op, mode, size) to stderr, suggesting
more ``--iters`` or an idle machine (:func:`noise_warnings`).
A ``zerotron plan --calibrate`` fit of these times gives each op's latency and busbw.
The overlap test runs a matmul (sized to take about as long as the all-reduce), the all-reduce,
and both together (async all-reduce, matmul, wait): hidden = (t_mm + t_ar - t_both) /
min(t_mm, t_ar), clipped to [0, 1]. On CPU the two compete for the same cores.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import torch
import torch.distributed as dist

from zerotron.bench.timing import (  # noqa: F401  (re-exported: zerotron.bench.comm.bandwidths, ...)
    _loop_times,
    _median_time,
    _sync,
    actual_bytes,
    bandwidths,
    format_size,
    timing_noise,
)
from zerotron.bench.topology import topology_report
from zerotron.distributed import comm
from zerotron.distributed.mesh import default_device, destroy, init_distributed
from zerotron.launch import launch, strip_nproc
from zerotron.launch_worker import in_worker
from zerotron.out_files import check_out_files, out_path, write_out_file

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
DEFAULT_SIZES = "4KiB:16MiB"
_NONBLOCKING_BUFFER_BYTES = 256 << 20  # at most this much memory for the K async all-reduce buffers
_TAG = "bench"
NOISE_MAX_MIN = 2.0  # a timing is noisy when max/min of its per-loop times exceeds this ...
NOISE_CV = 0.5  # ... or their coefficient of variation (pstdev / mean) does


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"4KiB"``, ``"16 MiB"``, ``"512B"`` or ``"4096"`` (int bytes).

    Units (case-insensitive): B, KiB, MiB, GiB (powers of 1024). Raises ValueError for anything
    else (decimal "KB"/"MB" are refused as ambiguous) and for sizes < 1 byte."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"bad size {text!r}: use an integer with unit B, KiB, MiB or GiB, e.g. 4KiB")
    n = int(m.group(1)) * UNITS[m.group(2).lower()]
    if n < 1:
        raise ValueError(f"bad size {text!r}: must be at least 1 byte")
    return n


def parse_sizes(spec: str) -> list[int]:
    """Sizes in bytes from ``"lo:hi"`` (every power of two from lo to hi, both powers of two) or a
    comma list ``"4KiB,1MiB,3MiB"``; returned sorted and unique. Raises ValueError on bad input."""
    spec = str(spec).strip()
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) != 2:
            raise ValueError(f"bad size range {spec!r}: use lo:hi, e.g. 4KiB:16MiB")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        for v, s in ((lo, parts[0]), (hi, parts[1])):
            if v & (v - 1):
                raise ValueError(f"bad size range {spec!r}: {s.strip()} is not a power of two "
                                 "(use a comma list for other sizes)")
        if lo > hi:
            raise ValueError(f"bad size range {spec!r}: lo must be <= hi")
        return [lo << i for i in range((hi // lo).bit_length())]
    items = [s for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError("no sizes given: use lo:hi or a comma list, e.g. 4KiB:16MiB")
    return sorted({parse_size(s) for s in items})


def is_noisy(spread: float, cv: float) -> bool:
    """The module docstring's rule: max/min > ``NOISE_MAX_MIN`` or CV > ``NOISE_CV``."""
    return spread > NOISE_MAX_MIN or cv > NOISE_CV


def noise_warnings(results: list[dict]) -> list[str]:
    """One warning line per result whose ``loop_spread``/``loop_cv`` are noisy (:func:`is_noisy`);
    results without those keys are skipped."""
    out = []
    for r in results:
        spread, cv = r.get("loop_spread"), r.get("loop_cv")
        if spread is None or cv is None or not is_noisy(spread, cv):
            continue
        out.append(f"warning: {r['op']} ({r['mode']}) {format_size(r['bytes'])}: noisy timing, per-loop times "
                   f"max/min {spread:.2f} (limit {NOISE_MAX_MIN:g}), CV {cv:.2f} (limit {NOISE_CV:g}); "
                   "rerun with more --iters or on an idle machine")
    return out


def _setup(op: str, nbytes: int, n: int, rank: int, dev):
    """Buffers for one ``op`` of nccl-tests size ``nbytes`` filled with a rank-dependent pattern.

    Returns ``(run, check)``: ``run()`` performs the op (blocking); ``check()`` is True when the
    output after exactly one ``run()`` equals the expected values."""
    k = nbytes // 4
    m = k // n

    def ar(count, start=0.0):
        return torch.arange(count, dtype=torch.float32, device=dev) + start

    if op == "all_reduce":
        t = ar(k, rank)
        return (lambda: comm.all_reduce(t, tag=_TAG)), (lambda: torch.equal(t, ar(k) * n + n * (n - 1) / 2))
    if op == "broadcast":
        t = ar(k, rank)
        return (lambda: comm.broadcast(t, src=0, tag=_TAG)), (lambda: torch.equal(t, ar(k)))
    if op == "all_gather":
        inp, out = ar(m, rank * m), torch.empty(k, device=dev)
        return (lambda: comm.all_gather(out, inp, tag=_TAG)), (lambda: torch.equal(out, ar(k)))
    if op == "reduce_scatter":
        inp, out = ar(n * m, rank), torch.empty(m, device=dev)
        return ((lambda: comm.reduce_scatter(out, inp, tag=_TAG)),
                (lambda: torch.equal(out, ar(m, rank * m) * n + n * (n - 1) / 2)))
    if op == "all_to_all":  # chunk j of rank r holds value r*n + j; afterwards chunk j holds j*n + rank
        inp = (rank * n + torch.arange(n, dtype=torch.float32, device=dev)).repeat_interleave(m)
        out = torch.empty(n * m, device=dev)
        want = (torch.arange(n, dtype=torch.float32, device=dev) * n + rank).repeat_interleave(m)
        return (lambda: comm.all_to_all(out, inp, tag=_TAG)), (lambda: torch.equal(out, want))
    if op == "p2p":
        s, r = ar(k, rank), torch.empty(k, device=dev)
        nxt, prv = (rank + 1) % n, (rank - 1) % n

        def ring():
            for w in comm.batch_isend_irecv([("send", s, nxt), ("recv", r, prv)], tag=_TAG):
                w.wait()
        return ring, (lambda: torch.equal(r, ar(k, prv)))
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def _time_nonblocking(nbytes: int, iters: int, dev) -> list[float]:
    """Seconds per all-reduce when ``iters`` async all-reduces are issued back to back, then waited,
    in each of 3 loops of one burst (:func:`_loop_times`)."""
    nb = max(2, min(iters, _NONBLOCKING_BUFFER_BYTES // nbytes))
    bufs = [torch.zeros(nbytes // 4, device=dev) for _ in range(nb)]

    def burst():
        for h in [comm.all_reduce(bufs[i % nb], async_op=True, tag=_TAG) for i in range(iters)]:
            h.wait()
    return [t / iters for t in _loop_times(burst, 3, 1, dev)]


def _overlap(nbytes: int, iters: int, warmup: int, dev) -> dict:
    """Matmul vs async all-reduce overlap on this rank; times are per-rank medians (seconds)."""
    buf = torch.zeros(nbytes // 4, device=dev)

    def ar():
        comm.all_reduce(buf, tag=_TAG)
    t_ar = _median_time(ar, iters, warmup, dev)
    mm, d = _matmul_of(t_ar, dev)  # t_mm ~ t_ar

    def both():
        h = comm.all_reduce(buf, async_op=True, tag=_TAG)
        mm()
        h.wait()
    return {"allreduce_bytes": nbytes, "matmul_dim": d, "matmul_flops": 2 * d ** 3,
            "t_allreduce_s": _median_time(ar, iters, warmup, dev),
            "t_matmul_s": _median_time(mm, iters, warmup, dev),
            "t_both_s": _median_time(both, iters, warmup, dev)}


def _matmul_of(seconds: float, dev):
    """A ``fn()`` running one (d, d) @ (d, d) matmul of about ``seconds`` on this device (d a
    multiple of 64, rank 0's choice) and that d."""
    d = 256
    for _ in range(2):
        x = torch.randn(d, d, device=dev)
        t_d = _median_time(lambda: x @ x, 3, 1, dev, barrier=False)
        d = int(min(8192, max(64, d * (seconds / max(t_d, 1e-9)) ** (1 / 3))) // 64 * 64)
    d = comm.all_gather_object(d)[0]
    a, b, c = (torch.randn(d, d, device=dev) for _ in range(3))
    return (lambda: torch.mm(a, b, out=c)), d


def _time_after_compute(run, mm, iters: int, warmup: int, dev) -> float:
    """Seconds a blocking collective adds when every call follows a matmul (as in tensor
    parallelism): time per (matmul, collective) pair minus time per matmul alone."""
    def pair():
        mm()
        run()
    return max(1e-7, _median_time(pair, iters, warmup, dev) - _median_time(mm, iters, warmup, dev))


def run_benchmark(ops, sizes, iters: int, warmup: int, dev) -> tuple[list[dict], dict]:
    """Measure on every rank (collective); returns ``(results, overlap)`` identical on all ranks.

    Raises RuntimeError if an op gives wrong values (checked once per op on <= 64KiB, where float32
    holds every value exactly)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    # (op, mode, requested, actual, local median seconds, (max/min, CV) of the loop times); the ~1 ms matmul
    local, mm = [], None
    for op in ops:
        if op == "p2p" and n == 1:
            continue
        run, check = _setup(op, actual_bytes(min(sizes[0], 64 << 10), n), n, rank, dev)
        run()
        _sync(dev)
        if not check():
            raise RuntimeError(f"bench comm: {op} gave wrong values on rank {rank}")
        for req in sizes:
            nb = actual_bytes(req, n)
            run, _ = _setup(op, nb, n, rank, dev)
            ts = _loop_times(run, iters, warmup, dev)
            local.append((op, "blocking", req, nb, statistics.median(ts), timing_noise(ts)))
            if op == "all_reduce":
                ts = _time_nonblocking(nb, iters, dev)
                local.append((op, "nonblocking", req, nb, statistics.median(ts), timing_noise(ts)))
                mm = mm or _matmul_of(1e-3, dev)[0]
                local.append((op, "after_compute", req, nb, _time_after_compute(run, mm, iters, warmup, dev), None))
    ov = _overlap(actual_bytes(sizes[-1], n), iters, warmup, dev)
    everyone = comm.all_gather_object((local, ov))
    results = []
    for i, (op, mode, req, nb, _, noise) in enumerate(local):
        t = max(r[0][i][4] for r in everyone)
        algbw, busbw = bandwidths(op, nb, t, n)
        results.append({"op": op, "mode": mode, "bytes": nb, "requested_bytes": req, "time_s": t,
                        "algbw_GBps": algbw, "busbw_GBps": busbw})
        if noise is not None:  # the worst rank's spread of its loop times
            results[-1]["loop_spread"] = max(r[0][i][5][0] for r in everyone)
            results[-1]["loop_cv"] = max(r[0][i][5][1] for r in everyone)
    overlap = {k: (max(r[1][k] for r in everyone) if k.startswith("t_") else v) for k, v in ov.items()}
    t_mm, t_ar, t_both = overlap["t_matmul_s"], overlap["t_allreduce_s"], overlap["t_both_s"]
    lo = min(t_mm, t_ar)
    overlap["hidden_fraction"] = min(1.0, max(0.0, (t_mm + t_ar - t_both) / lo)) if lo > 0 else 0.0
    overlap["note"] = ("CPU: the matmul and gloo's all-reduce threads compete for the same cores"
                       if dev.type == "cpu" else "CUDA: NCCL runs on its own stream beside the matmul")
    return results, overlap


def format_table(results: list[dict]) -> str:
    """Fixed-width table: op, mode, size, time (microseconds), algbw and busbw (GB/s)."""
    lines = [f"{'op':<15}{'mode':<15}{'size':>10}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in results:
        lines.append(f"{r['op']:<15}{r['mode']:<15}{format_size(r['bytes']):>10}{r['time_s'] * 1e6:>12.1f}"
                     f"{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}")
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str = "") -> None:
    """PNG of busbw (GB/s) vs size (bytes, log2 x axis), one line per (op, mode). Uses Agg only."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for key in dict.fromkeys((r["op"], r["mode"]) for r in results):
        rs = [r for r in results if (r["op"], r["mode"]) == key]
        ax.plot([r["bytes"] for r in rs], [r["busbw_GBps"] for r in rs], marker="o",
                linestyle="-" if key[1] == "blocking" else "--" if key[1] == "nonblocking" else ":",
                label=key[0] + ("" if key[1] == "blocking" else f" ({key[1].replace('_', ' ')})"))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v)) if v >= 1 else ""))
    ax.set_xlabel("size (bytes, nccl-tests convention)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out_path(path), dpi=110, bbox_inches="tight")


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron bench comm", allow_abbrev=False, formatter_class=HelpFormatter,
                                description="Collective bandwidth benchmark (nccl-tests algbw/busbw).")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {','.join(OPS)}")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="lo:hi (powers of two) or comma list, units B/KiB/MiB/GiB")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size, in 3 back-to-back loops (median loop)")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions before timing")
    p.add_argument("--json", help="write results to this JSON file (rank 0)")
    p.add_argument("--plot", help="write busbw-vs-size PNG here (rank 0)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="process-group backend")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument("--topology", default="auto", choices=["auto", "on", "off"], help="busbw per scope: "
                   "node-local groups, cross-node groups, world (zerotron.bench.comm_topo); auto = on across nodes")
    p.add_argument("--time-budget", type=float, default=120.0, help="seconds for the --topology sweeps "
                   "(larger sizes are left out, calls cut, to finish on slow links)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench comm``; returns an exit code (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    try:
        check_out_files({"--json": args.json, "--plot": args.plot})
        sizes = parse_sizes(args.sizes)
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            raise ValueError(f"unknown op(s) {bad or args.ops!r}; choose from {','.join(OPS)}")
        if args.iters < 1 or args.warmup < 0 or args.nproc < 1 or not args.time_budget > 0:
            raise ValueError("--iters must be >= 1, --warmup >= 0, --nproc >= 1 and --time-budget > 0")
    except ValueError as e:
        print(f"zerotron bench comm: error: {e}", file=sys.stderr)
        return 2
    if args.backend == "nccl" and not torch.cuda.is_available():
        print("zerotron bench comm: error: --backend nccl needs CUDA; use gloo", file=sys.stderr)
        return 2
    if args.nproc > 1 and not in_worker():
        return launch(args.nproc, strip_nproc(argv), module="zerotron.bench.comm")

    owned = not dist.is_initialized()
    dev = torch.device("cpu") if args.backend == "gloo" else default_device()
    rank, n, dev = init_distributed(args.backend, timeout_s=args.timeout, device=dev)
    try:
        topo = topology_report(dev)
        if args.topology == "on" or (args.topology == "auto" and len(topo["nodes"]) > 1):
            from zerotron.bench.comm_topo import report_topology, run_topology

            res = run_topology(ops, sizes, args.iters, args.warmup, dev, topo["nodes"], args.time_budget)
            if rank == 0:
                report_topology(args, ops, sizes, topo, res, noise_warnings)
            return 0
        results, overlap = run_benchmark(ops, sizes, args.iters, args.warmup, dev)
    finally:
        if owned:
            destroy()
    if rank == 0:
        print(f"zerotron bench comm: {topo['backend']} on {n} rank(s), {dev.type}, {topo['interconnect']}; "
              f"{args.iters} back-to-back calls in 3 loops (median loop) after {args.warmup} warmup, max over ranks; GB = 1e9 bytes")
        print(format_table(results))
        for line in noise_warnings(results):
            print(f"zerotron bench comm: {line}", file=sys.stderr)
        if "p2p" in ops and n == 1:
            print("p2p skipped: a ring needs at least 2 ranks")
        print(f"overlap: matmul {overlap['matmul_dim']}^2 {overlap['t_matmul_s'] * 1e3:.2f} ms, all-reduce "
              f"{format_size(overlap['allreduce_bytes'])} {overlap['t_allreduce_s'] * 1e3:.2f} ms, both "
              f"{overlap['t_both_s'] * 1e3:.2f} ms -> hidden fraction {overlap['hidden_fraction']:.2f} "
              f"({overlap['note']})")
        if args.json:
            write_out_file(args.json, json.dumps({"topology": topo, "results": results, "overlap": overlap,
                                                  "config": {"ops": ops, "sizes": sizes, "iters": args.iters,
                                                             "warmup": args.warmup}}, indent=2))
        if args.plot:
            plot(results, args.plot, f"busbw vs size: {topo['backend']}, {n} ranks, {dev.type}")
    return 0



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
