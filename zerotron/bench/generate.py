"""``zerotron bench generate``: inference throughput of the layouts side by side, alternated.

Usage: ``zerotron bench generate [--nproc N] [--checkpoint RUN] [--layouts single,dp,naive-mp,pp,tp,pp-tp]
[--prompts 32] [--new-tokens 100] [--microbatches M] [--rounds R] [--json F] [--markdown F] [--plot F]``.
Without ``--checkpoint`` the model is the default config's (configs/default.toml [model], vocab
4096), or ``--preset``'s (vocab 4096), with seeded random weights and the prompts random token ids (lengths 8..32, seeded): the
timings do not depend on the weights, only on the shapes. No eos stop (every request makes
``--new-tokens``), greedy.

Layouts on N ranks (:data:`LAYOUTS`): ``single`` (rank 0 alone, the others wait), ``dp`` (N replicas,
requests split), ``naive-mp`` (N pipeline stages, the batch as one micro-batch), ``pp`` (N stages,
``--microbatches`` micro-batches in flight, default one per stage), ``tp`` (N-way tensor parallel), ``pp-tp`` (2 stages x
N/2-way tp; needs N >= 4, else skipped), and ``pp-nocache`` (today's ``pipeline_generate``: greedy,
no KV cache, one prompt at a time over N stages, on the first ``--baseline-prompts`` prompts).
``ep`` / ``ep-tokens`` (mixture-of-experts models, e.g. ``--preset mixtral-tiny``): the N ranks one
expert-parallel group, E/N experts each (``Engine(ep=N)``); ``ep`` decodes every request on every
rank (``--ep-split replica``: the combine an all-gather over ep), ``ep-tokens`` gives each rank its
own requests and sends their tokens to the experts' owners by all-to-all (``--ep-split tokens``).
``single-compile`` / ``dp-compile``: the same with compiled decode steps (``Engine(compile=True)``,
``zerotron.inference.compiled``); their warm-up is one untimed generate of all the prompts (it
compiles every bucket the timed run uses), and the row reports the seconds compiled in it
(``compile_s``), the recompiles during the timed run (``recompiles_timed``, 0 expected) and the
ratio to the eager layout of each round (``ratio_vs_eager``, per round then the median);
``ratio_vs_ep`` (of ``ep-tokens``): output tokens/s over the ``ep`` layout's, per round then the median.
decode_tokens_per_s: tokens sampled by decode steps / the time of those steps (the prefill's
first token left out).

Method: each round runs every layout (order rotated by one per round) on a fresh copy of the same
model: one untimed warm-up generate (2 prompts x 4 tokens), a barrier, then the timed generate of
all prompts. output_tokens_per_s = new tokens / max over ranks of the wall time; ttft_s = time to
the first token of the first batch (max over ranks that sample); tpot_s_p50/p95 = percentiles of
the time between consecutive tokens of a batch (every decode step, all ranks); busy_fraction per
rank = compute time / wall time (embedding, blocks, head, sampling; the rest is waiting for
peers); cpu_fraction per rank = process CPU seconds / wall time (on a shared machine, busy time
includes waiting for a core, CPU time does not); weight_bytes_per_rank (measured storage) beside
estimated_weight_bytes_per_rank (the memory estimator's ``stage_num_params`` x bytes per element)
and kv_cache_bytes_per_rank (peak) per rank. Reported: medians
over rounds (per-rank lists from the last round).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from zerotron.bench.report import percentile
from zerotron.distributed import comm
from zerotron.distributed.mesh import ParallelDims, init_distributed, teardown
from zerotron.inference import Engine, Request, SamplingParams
from zerotron.launch import launch, strip_nproc
from zerotron.launch_worker import in_worker
from zerotron.out_files import check_out_files, out_path, write_out_file

from .train import _mesh

LAYOUTS = ("single", "dp", "naive-mp", "pp", "tp", "pp-tp", "pp-nocache", "single-compile", "dp-compile", "ep",
           "ep-tokens")
DEFAULT_LAYOUTS = "single,dp,naive-mp,pp,tp,pp-tp,pp-nocache"
ROW_KEYS = ("layout", "output_tokens_per_s", "ttft_s", "tpot_s_p50", "tpot_s_p95", "weight_bytes_per_rank",
            "kv_cache_bytes_per_rank", "busy_fraction")


def layout_dims(name: str, n: int, microbatches: int) -> tuple[ParallelDims, int]:
    """(ParallelDims, micro-batches) of layout ``name`` on ``n`` ranks (``pp-mK`` / ``pp-tp-mK``: K
    micro-batches instead of ``microbatches``). Raises ValueError for an unknown name or one that
    does not fit n."""
    if name in ("single-compile", "dp-compile"):
        return layout_dims(name[:-len("-compile")], n, microbatches)
    m = re.fullmatch(r"(pp|pp-tp)-m([1-9][0-9]*)", name)
    if m:
        return layout_dims(m.group(1), n, int(m.group(2)))
    if name == "single":
        return ParallelDims(1), 1
    if name in ("dp", "ep", "ep-tokens"):  # ep: the dp ranks form one expert-parallel group (expert_split)
        return ParallelDims(n, n, 1, 1), 1
    if name in ("naive-mp", "pp", "pp-nocache"):
        if n < 2:
            raise ValueError(f"layout {name!r} needs >= 2 ranks")
        return ParallelDims(n, 1, 1, n), ((microbatches or n) if name == "pp" else 1)
    if name == "tp":
        return ParallelDims(n, 1, n, 1), 1
    if name == "pp-tp":
        if n < 4 or n % 2:
            raise ValueError("layout 'pp-tp' (2 stages x N/2-way tp) needs an even N >= 4 ranks")
        return ParallelDims(n, 1, n // 2, 2), microbatches or 2
    raise ValueError(f"unknown layout {name!r}; valid: {', '.join(LAYOUTS)}")


def expert_split(name: str, n: int) -> tuple[int, str]:
    """(ep, ep_split) of layout ``name`` on ``n`` ranks: (n, "replica") for ``ep``, (n, "tokens") for
    ``ep-tokens``, else (1, "replica")."""
    return {"ep": (n, "replica"), "ep-tokens": (n, "tokens")}.get(name, (1, "replica"))


def _nocache(model, mesh, requests) -> tuple[list[list[int]], dict]:
    """Today's pipelined decoding (no KV cache, greedy, one prompt at a time)."""
    from zerotron.parallel.pipeline.generate import pipeline_generate
    from zerotron.parallel.pipeline.runner import PipelineStrategy
    from zerotron.plan import ParallelPlan

    strat = PipelineStrategy(model, mesh, ParallelPlan(mesh.dims))
    t0, out = time.perf_counter(), []
    first = None
    for r in requests:
        ids = pipeline_generate(strat, torch.tensor([r.prompt]), r.params.max_tokens)
        out.append(ids[0, len(r.prompt):].tolist())
        first = first or time.perf_counter() - t0
    wall = time.perf_counter() - t0
    n = sum(len(o) for o in out)
    from zerotron.inference.forward import weight_bytes
    return out, {"wall": wall, "busy": None, "cpu": None, "first": first, "steps": [wall / max(n, 1)] * n,
                 "weights": weight_bytes(strat.module), "kv": 0,
                 "estimated": estimated_weight_bytes(model.config, strat.module, mesh, strat.module.layer_ranges), "sampler": mesh.local_rank("pp") == 0}


def estimated_weight_bytes(model_config, holder: torch.nn.Module, mesh, layer_ranges=None, ep: int = 1) -> int:
    """Weight bytes the memory estimator predicts for this rank: parameters of its (tp shard of
    its) pipeline stage (:func:`zerotron.analysis.memory.stage_num_params`, tied embedding copy on
    the last stage included; ``layer_ranges``: the stages' layers, None = one stage; ``ep``: a
    mixture-of-experts model keeps E/ep experts per layer, :func:`~zerotron.analysis.moe_memory.moe_estimate`)
    times the bytes per element of ``holder``'s parameters."""
    from zerotron.analysis.memory import stage_num_params
    from zerotron.analysis.moe_memory import moe_estimate

    counts = [len(r) for r in layer_ranges] if layer_ranges is not None else None
    pp = len(counts) if counts else 1
    n = stage_num_params(model_config, mesh.size("tp"), pp, layer_counts=counts)[mesh.local_rank("pp") if pp > 1 else 0]
    if ep > 1:
        moe = moe_estimate(model_config, ep, ep)
        n -= moe["expert_params"] - moe["expert_params_per_rank"]
    return n * next(iter(holder.parameters())).element_size()


def run_layout(name: str, model, requests, n: int, microbatches: int, cache: dict, dev, pp_split: str = "") -> dict:
    """One timed run of layout ``name`` (collective over the world); the same record on every rank."""
    try:
        dims, m = layout_dims(name, n, microbatches)
        mesh = _mesh(cache, dims, n, dev)
    except ValueError as e:
        return {"layout": name, "skipped": True, "error": str(e)}
    local = None
    if mesh is not None:
        if name == "pp-nocache":
            if dims.world_size == n:
                comm.barrier()
            out, local = _nocache(copy.deepcopy(model), mesh, requests)
        else:
            compiled = name.endswith("-compile")
            ep, ep_split = expert_split(name, n)
            try:  # ep on a dense model, or not dividing its experts: the same reason on every rank
                eng = Engine(copy.deepcopy(model), mesh, microbatches=m, pp_split=pp_split if dims.pp > 1 else "",
                             compile=compiled, ep=ep, ep_split=ep_split)
            except ValueError as e:
                if ep == 1:
                    raise
                return {"layout": name, "skipped": True, "error": str(e)}
            from zerotron.parallel.compile import compile_stats
            c0 = compile_stats()
            if compiled:  # warm-up: every bucket of the timed run compiles here
                eng.generate(requests)
            else:
                eng.generate([Request(r.prompt, SamplingParams(max_tokens=4)) for r in requests[:2]])
            c1 = compile_stats()
            if dims.world_size == n:  # the clock starts together on every rank of the layout
                comm.barrier()
            out = eng.generate(requests)
            s = eng.stats
            c2 = compile_stats()
            local = {"wall": s.wall_s, "busy": s.busy_fraction, "cpu": s.cpu_s / s.wall_s if s.wall_s else None, "first": s.first_token_s, "steps": s.step_s,
                     "weights": eng.weight_bytes(), "kv": s.kv_cache_bytes,
                     "estimated": estimated_weight_bytes(eng.config, eng.holder, mesh,
                                                         eng.pipeline.stage.layer_ranges if eng.pipeline else None,
                                                         ep), "sampler": s.first_token_s is not None,
                     "compile_s": c1["compile_time_s"] - c0["compile_time_s"],
                     "recompiles_timed": c2["recompiles"] - c1["recompiles"] + c2["graphs"] - c1["graphs"]}
        local["tokens"] = sum(len(o) for o in out)
        local["out"] = out
    got = [g for g in comm.all_gather_object(local) if g]
    wall = max(g["wall"] for g in got)
    steps = [x for g in got for x in g["steps"]]
    firsts = [g["first"] for g in got if g["first"] is not None]
    return {"layout": name, "skipped": False, "world_size": dims.world_size, "dp": dims.dp, "tp": dims.tp,
            "pp": dims.pp, "microbatches": m, "pp_split": pp_split if dims.pp > 1 and name != "pp-nocache" else "",
            "requests": len(requests), "new_tokens": got[0]["tokens"],
            "output_tokens_per_s": got[0]["tokens"] / wall, "wall_s": wall,
            "ttft_s": max(firsts) if firsts else None, "tpot_s_p50": percentile(steps, 0.5), "tpot_s_p95": percentile(steps, 0.95),
            "weight_bytes_per_rank": [g["weights"] for g in got],
            "estimated_weight_bytes_per_rank": [g["estimated"] for g in got], "kv_cache_bytes_per_rank": [g["kv"] for g in got],
            "busy_fraction": [g["busy"] for g in got], "cpu_fraction": [g["cpu"] for g in got], "outputs": got[0]["out"],
            "decode_tokens_per_s": _decode_rate(got, len(requests)),
            "compile_s": max(g.get("compile_s", 0.0) for g in got),
            "recompiles_timed": max(g.get("recompiles_timed", 0) for g in got)}


def _decode_rate(got: list[dict], requests: int) -> float | None:
    """Tokens of decode steps per second of decode steps, over the ranks that decode."""
    secs = max(sum(g.get("steps", ())) for g in got)
    return (got[0]["tokens"] - requests) / secs if secs > 0 else None


def summarize(records: list[dict]) -> list[dict]:
    """Per-(round, layout) records -> one row per layout (medians over rounds; lists of the last round)."""
    rows = []
    for name in dict.fromkeys(r["layout"] for r in records):
        rs = [r for r in records if r["layout"] == name]
        if rs[0]["skipped"]:
            rows.append({k: v for k, v in rs[0].items() if k != "round"})
            continue
        row = {k: v for k, v in rs[-1].items() if k not in ("round", "outputs")}
        for k in ("output_tokens_per_s", "ttft_s", "tpot_s_p50", "tpot_s_p95", "wall_s", "decode_tokens_per_s"):
            vals = [r[k] for r in rs if r[k] is not None]
            row[k] = statistics.median(vals) if vals else None
        row["output_tokens_per_s_rounds"] = [r["output_tokens_per_s"] for r in rs]
        row["decode_tokens_per_s_rounds"] = [r.get("decode_tokens_per_s") for r in rs]
        row["compile_s"] = max(r.get("compile_s", 0.0) for r in rs)  # the first round compiles, later ones reuse it
        row["rounds"] = len(rs)
        rows.append(row)
    by = {r["layout"]: r for r in rows if not r["skipped"]}
    for row in rows:
        for base in ("single", "naive-mp", "pp-nocache", "ep"):  # paired per round
            if base in by and not row["skipped"]:
                a, b = row["output_tokens_per_s_rounds"], by[base]["output_tokens_per_s_rounds"]
                row[f"ratio_vs_{base}"] = statistics.median(x / y for x, y in zip(a, b))
        eager = row["layout"][:-len("-compile")] if row["layout"].endswith("-compile") else None
        if eager in by and not row["skipped"]:  # paired per round (the order rotates every round)
            a, b = row["decode_tokens_per_s_rounds"], by[eager]["decode_tokens_per_s_rounds"]
            pairs = [x / y for x, y in zip(a, b) if x and y]
            row["decode_ratio_vs_eager"] = statistics.median(pairs) if pairs else None
            row["decode_ratio_vs_eager_rounds"] = pairs
    return rows


def _mib(xs) -> str:
    return "/".join(f"{x / 2**20:.2f}" for x in xs)


def markdown_table(rows: list[dict]) -> str:
    """The comparison table (one row per layout) in markdown."""
    head = ("| layout | ranks (dp x tp x pp, m) | output tokens/s | vs naive-mp | TTFT s | TPOT p50 ms | TPOT p95 ms "
            "| weights MiB/rank (estimator) | KV cache MiB/rank | busy fraction/rank | CPU fraction/rank "
            "| decode tokens/s | decode vs eager | compile s (timed recompiles) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if r["skipped"]:
            lines.append(f"| {r['layout']} | skipped: {r['error']} |||||||||||||")
            continue
        def f(v, scale=1.0, d=3):
            return "n/a" if v is None else f"{v * scale:.{d}f}"
        busy = "/".join("n/a" if b is None else f"{b:.2f}" for b in r["busy_fraction"])
        cpu = "/".join("n/a" if b is None else f"{b:.2f}" for b in r.get("cpu_fraction", []))
        lines.append(f"| {r['layout']} | {r['dp']}x{r['tp']}x{r['pp']}, m={r['microbatches']} | "
                     f"{r['output_tokens_per_s']:.0f} | {f(r.get('ratio_vs_naive-mp'), d=2)} | {f(r['ttft_s'])} | "
                     f"{f(r['tpot_s_p50'], 1e3, 2)} | {f(r['tpot_s_p95'], 1e3, 2)} | {_mib(r['weight_bytes_per_rank'])} ({_mib(r['estimated_weight_bytes_per_rank'])}) | "
                     f"{_mib(r['kv_cache_bytes_per_rank'])} | {busy} | {cpu} | {f(r.get('decode_tokens_per_s'), d=0)} | "
                     f"{f(r.get('decode_ratio_vs_eager'), d=2)} | {f(r.get('compile_s'), d=1)} "
                     f"({r.get('recompiles_timed', 0)}) |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bar chart of output tokens/s per layout (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["skipped"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["layout"] for r in ok], [r["output_tokens_per_s"] for r in ok], color="tab:blue")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path(path), dpi=120)
    plt.close(fig)


def _model_and_prompts(args, dev):
    from zerotron.models.registry import build_model, preset_config

    if args.checkpoint:
        from zerotron.generate import load_model
        model, tok, _ = load_model(args.checkpoint, dev)
        vocab = model.config.vocab_size
    else:
        torch.manual_seed(0)
        vocab = args.vocab_size
        cfg = preset_config(args.preset, vocab_size=vocab) if args.preset else \
            preset_config("tiny", n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=vocab)
        model = build_model(cfg).to(dev).eval()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(8, 33, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    return model, [Request(p, SamplingParams(max_tokens=args.new_tokens, stop_at_eos=False)) for p in prompts]


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron bench generate", allow_abbrev=False, formatter_class=HelpFormatter,
                                description="Batched generation throughput of parallel layouts, alternated.")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes")
    p.add_argument("--checkpoint", help="run directory or checkpoints/step_N (default: the default model, random weights)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma list from: {', '.join(LAYOUTS)}; pp-mK and "
                   "pp-tp-mK set K micro-batches")
    p.add_argument("--preset", default="", help="model preset with random weights instead of the default config's "
                   "model (e.g. small); ignored with --checkpoint")
    p.add_argument("--prompts", type=int, default=32, help="requests (random token prompts of 8..32 tokens)")
    p.add_argument("--new-tokens", type=int, default=100, help="new tokens per request")
    p.add_argument("--microbatches", type=int, default=0, help="micro-batches of 'pp'/'pp-tp' (0 = one per stage)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the random-weight model")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (gloo) or cuda (NCCL, one GPU per rank; not yet run on a GPU)")
    p.add_argument("--pp-split", default="", help="layers per pipeline stage of the cached pipeline layouts: '' = "
                   "equal counts, 'decode' = balanced with the head's cost, or counts like 3,1")
    p.add_argument("--baseline-prompts", type=int, default=4, help="prompts of the slow 'pp-nocache' baseline")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the layout order rotates every round")
    for k in ("json", "plot", "markdown"):
        p.add_argument(f"--{k}", help=f"write the {k} output here (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench generate``; returns an exit code (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        check_out_files({"--json": args.json, "--plot": args.plot, "--markdown": args.markdown})
        names = [x.strip() for x in args.layouts.split(",") if x.strip()]
        bad = [x for x in names if x not in LAYOUTS and not re.fullmatch(r"(pp|pp-tp)-m[1-9][0-9]*", x)]
        if bad or not names:
            raise ValueError(f"unknown layout(s) {', '.join(bad) or '(none)'}; valid: {', '.join(LAYOUTS)}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if min(args.prompts, args.new_tokens, args.rounds, args.nproc, args.baseline_prompts, args.vocab_size) < 1 \
                or args.microbatches < 0:
            raise ValueError("--prompts, --new-tokens, --rounds, --nproc, --baseline-prompts, --vocab-size must be "
                             ">= 1 and --microbatches >= 0")
        if args.checkpoint:
            from zerotron.generate import resolve_checkpoint
            resolve_checkpoint(args.checkpoint)
        if args.nproc > 1 and not in_worker():
            return launch(args.nproc, strip_nproc(argv), module="zerotron.bench.generate")
    except SystemExit as e:
        return int(e.code or 0)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"zerotron bench generate: error: {e}", file=sys.stderr)
        return 2
    owned = not dist.is_initialized()
    if args.device == "cuda":
        rank, n, dev = init_distributed("nccl", 300, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    else:
        rank, n, dev = init_distributed("gloo", 300, torch.device("cpu"))
    model, requests = _model_and_prompts(args, dev)
    load0 = os.getloadavg()[0]
    m = args.microbatches  # 0: one per stage (layout_dims)
    cache, records = {}, []
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            reqs = requests[:args.baseline_prompts] if name == "pp-nocache" else requests
            records.append({**run_layout(name, model, reqs, n, m, cache, dev, args.pp_split), "round": r})
            comm.barrier()
    backend = dist.get_backend()
    if owned:
        teardown()
    if rank != 0:
        return 0
    ref = {r["layout"]: r.get("outputs") for r in records if not r["skipped"]}
    outs = [v for v in ref.values() if v is not None]
    same = all(o == outs[0][:len(o)] for o in outs)  # pp-nocache: a prefix of the prompts
    rows = summarize(records)
    for row in rows:
        row["outputs_equal_across_layouts"] = same
    gpu = f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {backend}"
               f"{gpu}, {n} rank(s), {torch.get_num_threads()} thread(s)/rank, load average {load0:.1f} at start / "
               f"{os.getloadavg()[0]:.1f} at end (a load above the core count leaves the ranks less than a core each)")
    print(f"zerotron bench generate: {machine}; {len(requests)} prompts x {args.new_tokens} new tokens; "
          f"outputs equal across layouts: {same}\n{markdown_table(rows)}")
    if args.json:
        write_out_file(args.json, json.dumps(rows, indent=1))
    if args.markdown:
        cmd = " ".join(["zerotron bench generate", *[f"--nproc {n}"] * (n > 1), *strip_nproc(argv)])
        write_out_file(args.markdown, f"# zerotron bench generate\n\n`{cmd}`\n\n{machine}; {len(requests)} prompts "
                                      f"x {args.new_tokens} new tokens, greedy; outputs equal across layouts: "
                                      f"{same}\n\n{markdown_table(rows)}")
    if args.plot:
        plot(rows, args.plot, f"zerotron bench generate: {machine}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
