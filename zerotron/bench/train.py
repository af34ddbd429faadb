"""``zerotron bench train``: training throughput of several parallel layouts, measured in one run.

Usage: ``zerotron bench train [--nproc N] [--config F] [--layouts dp,dp-torch,single] [--steps K]
[--warmup W] [--rounds R] [--json F] [--plot F.png] [--markdown F.md] [--section.field V ...]``
(also ``python -m zerotron.bench.train``). With ``--nproc > 1`` outside a worker the command
re-runs itself in N local workers (:func:`zerotron.launch.launch`).

A *layout* is a name plus config overrides (:data:`LAYOUTS`); ``--section.field`` overrides apply
to every layout, the layout's own on top. A layout runs on all N ranks, or on ranks 0..w-1 for
``world=w`` (the others wait at a barrier); such a layout gets N/w times the per-rank thread count,
so every layout uses the same cores (``--no-scale-threads`` turns this off). A layout whose config
is refused or whose strategy cannot be built is reported as skipped, with the error.

Method. In each round every layout (order rotated by one per round) is built from scratch (same
seed, so the same initial weights; data from the token cache), runs ``warmup`` untimed then
``steps`` timed ``train_step`` calls on the real global batches of steps 0, 1, ... A barrier over
all ranks precedes the clock. Per round: tokens/s = steps * global_batch * seq_len / max over ranks
of the elapsed seconds; step time = median over steps of the per-step seconds (max over ranks).
Reported: medians over rounds, and ratios as the median over rounds of the paired per-round ratio
(tokens/s of the layout / tokens/s of the baseline in the same round). comm bytes/step: bytes
counted by ``comm.STATS`` (nccl-tests size) during the timed steps / steps, max over ranks.
model-state bytes: ``Strategy.model_state_bytes`` (params + grads + optimizer state), max over
ranks. Peak memory: CPU, the peak RSS (VmHWM, bytes) of the step loop after resetting it through
/proc/self/clear_refs (else the process-lifetime ru_maxrss); CUDA, ``max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.distributed.mesh import Mesh

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"
BASELINES = ("dp-torch", "single")  # ratio columns: tokens/s relative to these layouts


@dataclass(frozen=True)
class Layout:
    """``overrides``: ``{"section.field": value}``; ``"{world}"`` in a value becomes the world size.
    ``world``: ranks used (None = all). ``new_strategy``: the layout needs more than plain DDP, so
    a plain ``DataParallel``/``TorchDDP`` from ``parallelize`` means "not implemented yet"."""

    name: str
    overrides: dict = field(default_factory=dict)
    world: int | None = None
    new_strategy: bool = False


LAYOUTS = {x.name: x for x in (
    Layout("dp", {"parallel.dp_impl": "native"}),
    Layout("dp-torch", {"parallel.dp_impl": "torch"}),
    Layout("single", {"parallel.dp_impl": "native"}, world=1),
    *(Layout(f"zero{s}", {"parallel.zero_stage": s}, new_strategy=True) for s in (1, 2, 3)),
    Layout("fsdp2", {"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}, new_strategy=True),
    Layout("tp", {"parallel.tp": "{world}"}, new_strategy=True),
    *(Layout(f"pp-{k}", {"parallel.pp": "{world}", "parallel.pp_schedule": k}, new_strategy=True)
      for k in ("gpipe", "1f1b")),
    Layout("pp-interleaved", {"parallel.pp": "{world}", "parallel.pp_schedule": "interleaved",
                              "parallel.virtual_stages": 2}, new_strategy=True),
)}
DEFAULT_LAYOUTS = "dp,dp-torch,single"


def parse_layouts(spec: str) -> list[str]:
    """Layout names from a comma list, unique, in order. Raises ValueError naming the valid ones."""
    names = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise ValueError(f"unknown layout(s) {', '.join(bad) or repr(spec)}; valid layouts: {', '.join(LAYOUTS)}")
    return names


def layout_config(path, overrides: list[tuple[str, str]], layout: Layout, world: int):
    """Config of ``layout``: the file, then the CLI ``overrides``, then the layout's own."""
    from zerotron.config import load_config

    own = [(k, str(v).format(world=world)) for k, v in layout.overrides.items()]
    return load_config(path, [*overrides, *own])


def paired_ratio(num: list[float], den: list[float]) -> float | None:
    """Median over rounds of ``num[r] / den[r]`` (None if either list is empty or has a zero)."""
    pairs = [a / b for a, b in zip(num, den) if a and b]
    return statistics.median(pairs) if pairs and len(pairs) == min(len(num), len(den)) else None


def summarize(records: list[dict]) -> list[dict]:
    """Per-round records -> one row per layout (first-seen order): medians and paired ratios."""
    rows = []
    for name in dict.fromkeys(r["layout"] for r in records):
        rs = [r for r in records if r["layout"] == name]
        if any(r.get("skipped") for r in rs):
            rows.append({"layout": name, "skipped": True, "error": rs[0]["error"], "world_size": rs[0]["world_size"],
                         "impl": None, "tokens_per_s": None, "step_time_s": None})
            continue
        tps = [r["tokens_per_s"] for r in rs]
        row = {k: v for k, v in rs[-1].items() if k not in ("round", "tokens_per_s", "step_time_s")}
        row.update(tokens_per_s=statistics.median(tps), tokens_per_s_rounds=tps,
                   step_time_s=statistics.median(r["step_time_s"] for r in rs), skipped=False)
        for k in ("comm_bytes_per_step", "peak_mem_bytes"):
            row[k] = max(r[k] for r in rs) if all(r[k] is not None for r in rs) else None
        rows.append(row)
    for row in rows:
        for base in BASELINES:
            ref = [r.get("tokens_per_s_rounds") or [] for r in rows if r["layout"] == base]
            row[f"ratio_vs_{base.replace('-', '_')}"] = (
                paired_ratio(row.get("tokens_per_s_rounds") or [], ref[0]) if ref else None)
    return rows


def _fmt(v, spec: str = ",.0f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(rows: list[dict]) -> str:
    """Markdown table: one line per layout (skipped ones with their error)."""
    bases = [b for b in BASELINES if any(r["layout"] == b for r in rows)]
    head = ["layout", "impl", "world", "tokens/s (median)", "min-max", "step time ms",
            *[f"vs {b}" for b in bases], "comm bytes/step", "model-state bytes/rank", "peak mem MiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in rows:
        if r["skipped"]:
            out.append(f"| {r['layout']} | skipped: {r['error'][:160]} |" + " |" * (len(head) - 2))
            continue
        tps = r["tokens_per_s_rounds"]
        cells = [r["layout"], r["impl"], str(r["world_size"]), _fmt(r["tokens_per_s"]),
                 f"{min(tps):,.0f}-{max(tps):,.0f}", _fmt(r["step_time_s"] * 1e3, ".1f"),
                 *[_fmt(r[f"ratio_vs_{b.replace('-', '_')}"], ".3f") for b in bases],
                 _fmt(r["comm_bytes_per_step"], ","), _fmt(r["model_state_bytes"], ","),
                 _fmt(r["peak_mem_bytes"] and r["peak_mem_bytes"] / 2**20, ",.0f")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Bar chart PNG: median tokens/s per layout, whiskers = min/max over rounds (matplotlib Agg)."""
    from matplotlib.figure import Figure

    rows = [r for r in rows if not r["skipped"]]
    fig = Figure(figsize=(1.6 * len(rows) + 2, 4))
    ax = fig.add_subplot()
    med = [r["tokens_per_s"] for r in rows]
    err = [[m - min(r["tokens_per_s_rounds"]) for m, r in zip(med, rows)],
           [max(r["tokens_per_s_rounds"]) - m for m, r in zip(med, rows)]]
    bars = ax.bar([f"{r['layout']}\n({r['world_size']} rank{'s' * (r['world_size'] > 1)})" for r in rows], med,
                  yerr=err, capsize=4, color=["C0", "C1", "C2", "C3", "C4", "C5", "C6"][:len(rows)] * 2)
    ax.bar_label(bars, labels=[f"{m:,.0f}" for m in med], label_type="center", color="white")
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


# ---------------------------------------------------------------------------- measurement (workers)
def _reset_peak(dev) -> str:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return "cuda_max_allocated"
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back so the reset starts low
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
        return "rss"
    except OSError:
        return "rss_lifetime"


def _peak_bytes(dev, kind: str) -> int:
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    if kind == "rss":
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _SubMesh(Mesh):
    """A ("pp", "dp", "tp") mesh over global ranks 0..w-1 (``dm``: its DeviceMesh); Mesh's interface."""

    def __init__(self, dims, device, dm, rank: int):  # noqa: D107 - no super().__init__: that spans the world
        self.dims, self.device, self.mesh, self.rank, self.coords = dims, device, dm, rank, dims.coords(rank)
        self._groups = {n: comm.NamedGroup(dm.get_group(n), n) for n in ("pp", "dp", "tp")}


def _mesh(cache: dict, dims, n: int, device):
    """Mesh for ``dims`` (cached; built on ALL ranks); None on ranks outside a sub-world."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (dims.world_size, dims.dp, dims.tp, dims.pp)
    if key not in cache:
        if dims.world_size == n:
            cache[key] = Mesh(dims, device)
        else:
            dm = DeviceMesh(device.type, torch.arange(dims.world_size).view(dims.pp, dims.dp, dims.tp),
                            mesh_dim_names=("pp", "dp", "tp"))
            r = dist.get_rank()
            cache[key] = _SubMesh(dims, device, dm, r) if r < dims.world_size else None
    return cache[key]


def _build(cfg, mesh, data, layout: Layout, steps: int):
    """Model, strategy, optimizer, scheduler and the micro-batches of steps 0..steps-1."""
    from zerotron.data import GlobalBatchSampler, batch_from_indices, num_windows
    from zerotron.models.gpt import GPT
    from zerotron.parallel import DataParallel, TorchDDP, parallelize
    from zerotron.train.optim import build_scheduler, decay_mask
    from zerotron.train.trainer import gpt_config

    mcfg = gpt_config(cfg, data.vocab_size)
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank and layout
    model = GPT(mcfg).to(mesh.device)
    strategy = parallelize(model, cfg, mesh)
    if layout.new_strategy and type(strategy) in (DataParallel, TorchDDP):
        raise NotImplementedError(f"parallelize() returned a plain {type(strategy).__name__} for "
                                  f"{layout.overrides}: this strategy is not implemented yet")
    opt = strategy.build_optimizer(cfg.train, decay_mask(model))
    sampler = GlobalBatchSampler(num_windows(len(data.train), mcfg.block_size), cfg.train.global_batch, cfg.train.seed)
    mb, dpr, dp = cfg.train.micro_batch, mesh.local_rank("dp"), mesh.size("dp")
    batches = []
    for s in range(steps):
        idx = sampler.local_indices(s, dpr, dp)
        batches.append([batch_from_indices(data.train, idx[i:i + mb], mcfg.block_size) for i in range(0, len(idx), mb)])
    torch.manual_seed(cfg.train.seed + 1 + mesh.rank)
    return strategy, opt, build_scheduler(opt, cfg.train), batches, model.num_params(), mcfg.block_size


def run_layout(layout: Layout, cfg, mesh, data, steps: int, warmup: int, dev, threads: int) -> dict:
    """One round of one layout; collective over the whole world (ranks outside ``mesh`` wait).
    Returns the same record on every rank: tokens/s, step time (s), bytes, peak memory (bytes)."""
    from zerotron.train.step import train_step

    w = mesh.dims.world_size if mesh is not None else (layout.world or dist.get_world_size())
    rec = {"layout": layout.name, "world_size": w}
    kind, err, built, local = _reset_peak(dev), None, None, None
    if mesh is not None:
        try:
            built = _build(cfg, mesh, data, layout, warmup + steps)
        except Exception as e:  # noqa: BLE001 - a layout that cannot be built is reported, not fatal
            err = f"{type(e).__name__}: {e}"
    errs = [e for e in comm.all_gather_object(err) if e]
    if errs:
        return {**rec, "skipped": True, "error": errs[0]}
    if built:
        strat, opt, sched, batches, n_params, seq_len = built
        t, prev = cfg.train, torch.get_num_threads()
        torch.set_num_threads(threads)
        for s in range(warmup):
            train_step(strat, opt, sched, batches[s], mesh.group("dp"), t.grad_clip, t.dtype, dev)
    comm.barrier()
    if built:
        before, times = dict(comm.STATS.bytes), []
        t0 = time.perf_counter()
        for s in range(warmup, warmup + steps):
            t1 = time.perf_counter()
            train_step(strat, opt, sched, batches[s], mesh.group("dp"), t.grad_clip, t.dtype, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t1)
        elapsed = time.perf_counter() - t0
        by_tag: dict = {}
        for k, v in comm.STATS.bytes.items():
            if v - before.get(k, 0):
                by_tag[k[2] or "-"] = by_tag.get(k[2] or "-", 0) + (v - before.get(k, 0)) // steps
        local = {"elapsed": elapsed, "times": times, "by_tag": by_tag, "state": strat.model_state_bytes(opt),
                 "peak": _peak_bytes(dev, kind), "impl": type(strat).__name__, "params": n_params,
                 "tokens": t.global_batch * seq_len}
        torch.set_num_threads(prev)
        del built, strat, opt, sched, batches
    got = [x for x in comm.all_gather_object(local) if x]
    step_times = [max(ts) for ts in zip(*(g["times"] for g in got))]
    state = max((g["state"] for g in got), key=lambda s: s["total_bytes"])
    return {**rec, "skipped": False, "impl": got[0]["impl"], "threads": threads, "num_params": got[0]["params"],
            "tokens_per_step": got[0]["tokens"], "tokens_per_s": got[0]["tokens"] * steps / max(g["elapsed"] for g in got),
            "step_time_s": statistics.median(step_times), "step_times_s": step_times,
            "comm_bytes_per_step": max(sum(g["by_tag"].values()) for g in got), "comm_bytes_by_tag": got[0]["by_tag"],
            "model_state_bytes": state["total_bytes"], "model_state": state,
            "peak_mem_bytes": max(g["peak"] for g in got), "peak_mem_kind": kind}


def run_benchmark(path, overrides, names: list[str], steps: int, warmup: int, rounds: int, dev, data,
                  scale_threads: bool = True) -> list[dict]:
    """All rounds on every rank (collective); per-(round, layout) records, identical on all ranks."""
    from zerotron.config import validate
    from zerotron.distributed.mesh import ParallelDims

    n, base_threads, cache, skipped, records = dist.get_world_size(), torch.get_num_threads(), {}, {}, []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            layout = LAYOUTS[name]
            w = layout.world or n
            if name not in skipped:
                try:
                    if w > n:
                        raise ValueError(f"layout {name!r} needs {w} ranks, the run has {n}")
                    cfg = layout_config(path, overrides, layout, n)
                    validate(cfg, w)
                    mesh = _mesh(cache, ParallelDims(w, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp), n, dev)
                except ValueError as e:  # ConfigError and DataError are ValueErrors
                    skipped[name] = {"layout": name, "world_size": w, "skipped": True, "error": str(e)}
            if name in skipped:
                records.append({**skipped[name], "round": r})
                continue
            threads = base_threads * n // w if scale_threads else base_threads
            rec = run_layout(layout, cfg, mesh, data, steps, warmup, dev, threads)
            if rec["skipped"]:
                skipped[name] = rec
            records.append({**rec, "round": r})
    return records


def markdown_report(rows: list[dict], command: str, machine: str) -> str:
    """The --markdown file: command, machine, model, the table, and how to read it."""
    ok = [r for r in rows if not r["skipped"]] or [{}]
    r0 = ok[0]
    lines = [f"# Training throughput: {', '.join(r['layout'] for r in rows)}", "", f"Command: `{command}`", "",
             f"Machine: {machine}", "",
             f"Model: {_fmt(r0.get('num_params'), ',')} parameters, {_fmt(r0.get('tokens_per_step'), ',')} tokens per "
             f"optimizer step; {len(r0.get('tokens_per_s_rounds', []))} round(s) of "
             f"{len(r0.get('step_times_s', []))} timed steps per layout.", "", format_table(rows), "",
             "tokens/s: median over rounds (min-max across rounds beside it); `vs X`: median over rounds of the "
             "paired ratio tokens/s(layout) / tokens/s(X) in the same round; comm bytes/step: counted by "
             "zerotron.distributed.comm (on 1 rank the all-reduces move nothing); peak mem: " +
             str(r0.get("peak_mem_kind", "-")) + " per rank, max over ranks. Method: zerotron/bench/train.py."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerotron bench train", allow_abbrev=False,
                                description="Training throughput of parallel layouts, alternated round by round. "
                                "Config fields can be overridden for all layouts as --section.field VALUE.")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes (default 1)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config (default configs/default.toml)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma list from {','.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per layout and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the layout order rotates each round")
    p.add_argument("--no-scale-threads", action="store_true", help="keep the per-rank thread count on sub-world layouts")
    for k in ("json", "plot", "markdown"):
        p.add_argument(f"--{k}", help=f"write the {k} output here (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench train``; returns an exit code (2 for bad arguments)."""
    from zerotron.cli import _strip_nproc
    from zerotron.config import load_config, parse_overrides, validate
    from zerotron.launch import in_worker, launch

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, rest = _parser().parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        names = parse_layouts(args.layouts)
        if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.nproc < 1:
            raise ValueError("--steps, --rounds and --nproc must be >= 1 and --warmup >= 0")
        overrides = parse_overrides(rest)
        cfg = load_config(args.config, overrides)
        n = int(os.environ["WORLD_SIZE"]) if in_worker() else args.nproc
        validate(cfg, n)
        if args.nproc > 1 and not in_worker():
            from zerotron.data import prepare_data

            d = cfg.data  # build the token cache once, before the workers start
            prepare_data(d.corpus, d.path or None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir,
                         d.tokenizer or None)
            return launch(args.nproc, _strip_nproc(argv), module="zerotron.bench.train")
    except (ValueError, FileNotFoundError) as e:  # ConfigError, DataError
        print(f"zerotron bench train: error: {e}", file=sys.stderr)
        return 2
    from zerotron.distributed.mesh import destroy, init_distributed
    from zerotron.train.trainer import load_data

    owned = not dist.is_initialized()
    rank, n, dev = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s,
                                    torch.device("cpu") if cfg.train.device == "cpu" else None)
    try:
        data = load_data(cfg, int(os.environ.get("LOCAL_RANK", 0)))
        records = run_benchmark(args.config, overrides, names, args.steps, args.warmup, args.rounds, dev, data,
                                not args.no_scale_threads)
        backend = dist.get_backend()
    finally:
        if owned:
            destroy()
    if rank != 0:
        return 0
    rows = summarize(records)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
               f"{backend} over {n} rank(s), device {dev.type}"
               + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
               + f", {torch.get_num_threads()} thread(s) per rank")
    command = "zerotron bench train " + " ".join([f"--nproc {n}"] * (n > 1) + _strip_nproc(argv))
    print(f"zerotron bench train: {machine}\n{format_table(rows)}")
    for r in rows:
        if r["layout"] != "dp-torch" and r.get("ratio_vs_dp_torch") is not None:
            print(f"{r['layout']} / dp-torch tokens/s: {r['ratio_vs_dp_torch']:.3f} (goal >= 1.0)")
        if r["layout"] != "single" and r.get("ratio_vs_single") is not None:
            print(f"{r['layout']} speed-up vs single process: {r['ratio_vs_single']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot, f"zerotron bench train: {machine}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown_report(rows, command, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
