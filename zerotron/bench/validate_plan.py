"""Validate the planner's step-time model against a measured ``zerotron bench train`` run.

Usage: ``zerotron bench plan`` (or ``python -m zerotron.bench.validate_plan``) ``--bench-train benchmarks/strategies_cpu.json
--bench-comm comm.json [--config configs/default.toml] [--peak-flops F] [--threads T]
[--compute-eff 0.5] [--out F.md] [--json F.json]``.

Method. A "cpu" :class:`~zerotron.analysis.hardware.Hardware` profile is built on this machine:
peak FLOP/s = :func:`zerotron.train.metrics.measure_peak_flops` of this process with ``T``
intra-op threads (default: the bench run's threads per rank), i.e. the peak of one rank, not
assumed; every link's busbw = the measured busbw of the ``zerotron bench comm --json`` file
(:func:`~zerotron.analysis.hardware.calibrate`: largest size per op, blocking mode; ops it lacks
get the all-reduce busbw); one node holds all ranks; communicated elements are fp32 (4 bytes, the
CPU training dtype). Each measured bench layout is mapped to a planner layout on its world size
(:func:`planner_layout`; micro-batch and global batch from ``--config``, which must match the
bench run's parameters and tokens per step) and priced by
:func:`~zerotron.analysis.layout_cost.evaluate`. Reported: predicted vs measured tokens/s per layout
and the Spearman rank correlation between them (average ranks for ties, numpy only).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.flops import gpt_num_params
from zerotron.analysis.hardware import OPS, calibrate, custom_hardware
from zerotron.analysis.layout_cost import evaluate
from zerotron.analysis.plan_cli import _model_from_args
from zerotron.bench.layouts import get_layout
from zerotron.config import load_config
from zerotron.host_heap import physical_bytes
from zerotron.out_files import check_out_files, write_out_file

from .profile import measure_profile

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"
GOAL = 0.8  # Spearman rank correlation the planner should reach


def planner_layout(name: str, world: int, micro_batch: int) -> tuple[dict, bool] | None:
    """``(planner layout, sequence parallel)`` of a ``zerotron bench train`` layout run on ``world``
    ranks, or None for a layout with no planner counterpart. dp-torch prices as dp (same all-reduce),
    tp-dtensor as tp;
    fsdp2-zeroS as ZeRO-S; single / single-mt as dp = 1; the HSDP layouts (hsdp-zeroS, fsdp2-hsdp,
    dp-hier) as their ZeRO stage with ``dp_replicate = 2`` (on an even world); pp-zb-h1, pp-zb-v and
    pp-threads-gpipe and pp-torch-* have none (the planner prices neither the ZB-H1 schedule, threads
    nor torch's pipelining backend), nor do the context-parallel layouts (cp-*, dp-cp-*), the MoE ones (moe-*) and the optimizer-offload ones
    (zeroS-offload, zeroS-offdisk: the planner does not price the host link yet). Suffixes ``-mbN`` / ``-ac...``
    (:func:`zerotron.bench.layouts.get_layout`) set the micro-batch and recompute; ``micro_batch``
    is the config's otherwise."""
    try:
        over = get_layout(name).overrides
    except ValueError:
        return None
    if over.get("train.offload", "none") != "none":
        return None
    mb = int(over.get("train.micro_batch", micro_batch))
    base = dict(dp=world, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=mb,
                recompute=over.get("train.activation_checkpointing", "none"))
    name = name.split("-mb")[0].split("-ac")[0]
    if name in ("dp", "dp-torch", "single", "single-mt"):
        return base, False
    hsdp = {"hsdp-zero2": 2, "hsdp-zero3": 3, "fsdp2-hsdp": 3, "dp-hier": 0}  # 2 replicas (parallel.dp_replicate)
    if name in hsdp and world % 2 == 0:
        return {**base, "zero_stage": hsdp[name], "dp_replicate": 2}, False
    for s in (1, 2, 3):
        if name in (f"zero{s}", f"fsdp2-zero{s}"):
            return {**base, "zero_stage": s}, False
    if name in ("tp", "tp-sp", "tp-dtensor"):
        return {**base, "dp": 1, "tp": world}, name == "tp-sp"
    if name.startswith("pp-") and name[3:] in ("gpipe", "1f1b", "interleaved"):
        return {**base, "dp": 1, "pp": world, "schedule": name[3:]}, False
    return None


def ranks(x) -> np.ndarray:
    """1-based ranks of ``x`` (ascending), ties get the average of their ranks."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman(a, b) -> float:
    """Spearman rank correlation: Pearson correlation of the average ranks. Raises ValueError for
    fewer than 3 pairs, unequal lengths or a constant input."""
    if len(a) != len(b) or len(a) < 3:
        raise ValueError(f"need two equal-length sequences of >= 3 values, got {len(a)} and {len(b)}")
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    if den == 0:
        raise ValueError("a constant sequence has no rank correlation")
    return float((ra * rb).sum() / den)


def cpu_hardware(comm_bench: dict, peak_flops: float, memory: int, vector_rate: float) -> tuple:
    """("cpu" Hardware calibrated from a ``bench comm --json`` dict, world size of that run): every
    op's latency and busbw from :func:`~zerotron.analysis.hardware.calibrate` (ops it lacks get
    the all-reduce's), ``vector_rate`` element passes/s, one node (the inter-node link = the
    intra-node one) -- unless the file is a multi-node ``--topology`` run with inter-node results
    (e.g. the two-node harness): then the inter-node link is calibrated from those. Returns
    ``(hw, world size of that run, nodes)`` (nodes = 1 for a one-node profile)."""
    res = [r for r in comm_bench.get("results", []) if r.get("op") == "all_reduce" and r.get("busbw_GBps", 0) > 0]
    if not res:
        raise ValueError("the bench comm file has no all_reduce busbw")
    ar = max(res, key=lambda r: (r.get("mode", "blocking") == "blocking", r["bytes"]))["busbw_GBps"] * 1e9
    hw = calibrate(custom_hardware("cpu", peak_flops, memory, ar, vector_rate), comm_bench)
    nodes = len(comm_bench.get("topology", {}).get("nodes") or [None])
    if nodes < 2 or not any(r.get("scope") == "inter" for r in comm_bench.get("results", [])):
        nodes = 1
        hw = replace(hw, inter=dict(hw.intra), latency_inter=dict(hw.latency_intra))
    return hw, int(comm_bench.get("topology", {}).get("world_size", 0)), nodes


def predict(rows: list[dict], cfg, global_batch: int, micro_batch: int, hw, compute_eff: float,
            elem_bytes: int = 4, launch_s: float = 20e-6, nodes: int = 1) -> list[dict]:
    """One record per measured (not skipped) bench row with a planner counterpart: layout, world,
    the planner layout, measured and predicted tokens/s and step time, the predicted breakdown.
    ``nodes`` > 1: the largest world's ranks split evenly over that many nodes (gpus_per_node)."""
    out = []
    world_max = max([r["world_size"] for r in rows if not r.get("skipped")], default=1)
    for r in rows:
        if r.get("skipped"):
            continue
        mapped = planner_layout(r["layout"], r["world_size"], micro_batch)
        if mapped is None:
            continue
        lay, sp = mapped
        tps = r["tokens_per_s"]
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps <= 0:
            raise ValueError(f"layout {r['layout']!r}: tokens_per_s must be a positive finite number, got {tps!r}")
        per_node = world_max // nodes if nodes > 1 and world_max % nodes == 0 else world_max
        cm = CostModel(hw, gpus_per_node=per_node, compute_eff=compute_eff, overhead=0, sp=sp,
                       elem_bytes=elem_bytes, launch_s=launch_s)
        p = evaluate(cfg, lay, cfg.block_size, global_batch, cm)
        out.append({"layout": r["layout"], "world_size": r["world_size"],
                    "planner_layout": {**lay, "sp": sp}, "measured_tokens_per_s": r["tokens_per_s"],
                    "measured_step_time_s": r["step_time_s"],
                    "measured_best_round_tokens_per_s": max(r.get("tokens_per_s_rounds") or [r["tokens_per_s"]]),
                    "predicted_tokens_per_s": p["predicted_tokens_per_s"],
                    "predicted_step_time_s": p["predicted_step_time_s"],
                    "predicted_breakdown_s": p["time_breakdown_s"]})
    return out


def trace_predictions(preds: list[dict], config: str, hw, compute_eff: float, launch_s: float) -> None:
    """Add to each record of :func:`predict` the step time predicted from a dry run of its layout
    (:func:`zerotron.analysis.dryrun.dry_run` on its world size, the layout's overrides on ``config``,
    every rank on one node, the same ``hw``, ``compute_eff`` and per-layer ``launch_s``;
    :mod:`zerotron.analysis.trace_time`): ``trace_step_time_s``, ``trace_tokens_per_s``,
    ``trace_breakdown_s``, ``trace_flops`` (FLOPs of rank 0's step) and ``trace_wall_s`` (seconds the
    dry run took). A layout the dry run cannot trace gets ``trace_error``."""
    import time

    from zerotron.analysis.dryrun import DryRunError, dry_run
    from zerotron.config import ConfigError

    for p in preds:
        lay = get_layout(p["layout"])
        own = [(k, str(v).format(world=p["world_size"])) for k, v in lay.overrides.items()]
        t0 = time.perf_counter()
        try:
            cfg = load_config(config, own)
            recs = dry_run(cfg, p["world_size"], hw=hw, gpus_per_node=p["world_size"], compute_eff=compute_eff,
                           launch_s=launch_s)
        except (DryRunError, ConfigError, ValueError) as e:
            p["trace_error"] = str(e)
            continue
        st = recs[0]["step_time"]["trace"]
        tokens = cfg.train.global_batch * cfg.model.block_size
        p.update(trace_step_time_s=st["step_s"], trace_tokens_per_s=tokens / st["step_s"],
                 trace_breakdown_s=st["breakdown_s"], trace_flops=recs[0]["flops_traced"],
                 trace_wall_s=time.perf_counter() - t0)


def correlation(preds: list[dict], measured: str = "measured_tokens_per_s",
                predicted: str = "predicted_tokens_per_s") -> float:
    """Spearman of ``predicted`` vs ``measured`` (keys of the records) tokens/s."""
    return spearman([p[predicted] for p in preds], [p[measured] for p in preds])


def correlations(preds: list[dict]) -> dict:
    """Spearman over all layouts (``all``), over the layouts of the largest world only (``same_world``:
    what ``plan`` ranks, a fixed device count; None under 3 layouts), over the strategy layouts
    without -mbN / -ac suffixes (``base_layouts``; None unless some layouts have suffixes), and
    against the best round's tokens/s instead of the median (``best_round``: less sensitive to other
    jobs on the machine)."""
    top = max(p["world_size"] for p in preds)
    same = [p for p in preds if p["world_size"] == top]
    base = [p for p in preds if "-mb" not in p["layout"] and "-ac" not in p["layout"]]
    out = {"all": correlation(preds), "same_world": correlation(same) if len(same) >= 3 else None,
           "same_world_size": top, "same_world_layouts": len(same),
           "base_layouts": correlation(base) if 3 <= len(base) < len(preds) else None, "base_layouts_n": len(base)}
    if all(p.get("measured_best_round_tokens_per_s") for p in preds):
        out["best_round"] = correlation(preds, "measured_best_round_tokens_per_s")
    traced = [p for p in preds if "trace_tokens_per_s" in p]
    if len(traced) >= 3:  # the dry-run trace's prediction (bench plan --trace), on the layouts it traced
        out["trace"] = correlation(traced, predicted="trace_tokens_per_s")
        out["formula_on_traced"] = correlation(traced)
        out["trace_n"] = len(traced)
    return out


def format_table(preds: list[dict]) -> str:
    mr = ranks([-p["measured_tokens_per_s"] for p in preds])
    pr = ranks([-p["predicted_tokens_per_s"] for p in preds])
    trace = any("trace_tokens_per_s" in p for p in preds)
    out = ["| layout | world | planner layout | measured tok/s | predicted tok/s | predicted/measured | "
           "measured rank | predicted rank | predicted compute ms | comm ms | bubble ms |"
           + (" trace tok/s | trace/measured |" if trace else ""),
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if trace else "")]
    for p, a, b in zip(preds, mr, pr):
        lay, bd = p["planner_layout"], p["predicted_breakdown_s"]
        desc = (f"dp{lay['dp']} tp{lay['tp']}{'+sp' if lay['sp'] else ''} pp{lay['pp']} z{lay['zero_stage']} "
                f"{lay['schedule']} mb{lay['micro_batch']}"
                + (f" ac-{lay['recompute']}" if lay.get("recompute", "none") != "none" else ""))
        comm_s = bd["dp_comm"] + bd["tp_comm"] + bd["pp_comm"] + bd.get("cp_comm", 0.0)
        out.append(f"| {p['layout']} | {p['world_size']} | {desc} | {p['measured_tokens_per_s']:,.0f} | "
                   f"{p['predicted_tokens_per_s']:,.0f} | "
                   f"{p['predicted_tokens_per_s'] / p['measured_tokens_per_s']:.2f} | {a:g} | {b:g} | {(bd['compute'] + bd['vector'] + bd['overhead']) * 1e3:.1f} | {comm_s * 1e3:.1f} | "
                   f"{bd['bubble'] * 1e3:.1f} |"
                   + ((f" {p['trace_tokens_per_s']:,.0f} | {p['trace_tokens_per_s'] / p['measured_tokens_per_s']:.2f} |"
                       if "trace_tokens_per_s" in p else " - | - |") if trace else ""))
    return "\n".join(out)


def _f3(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron bench plan", formatter_class=HelpFormatter, description="Spearman rank "
                                "correlation of the planner's predicted tokens/s vs a bench train run.")
    p.add_argument("--bench-train", required=True, help="'zerotron bench train --json' file")
    p.add_argument("--bench-comm", required=True, help="'zerotron bench comm --json' file (same machine)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="config of the bench train run")
    p.add_argument("--peak-flops", type=float, help="per-rank peak FLOP/s (default: measured now)")
    p.add_argument("--threads", type=int, help="intra-op threads for the peak (default: the bench run's)")
    p.add_argument("--compute-eff", type=float, help="achieved/peak FLOP/s (default: measured on the model's MLP matmul)")
    p.add_argument("--profile", help="take the CPU profile (peak FLOP/s, compute_eff, vector rate, per-layer "
                                     "overhead) from an earlier 'bench plan --json' file instead of measuring it now "
                                     "(a loaded machine measures too low)")
    p.add_argument("--trace", action="store_true",
                   help="also predict each layout's step time from a dry run of its real code (zerotron dryrun's "
                        "FLOP, element-pass and collective counts on the same profile) and rank those")
    p.add_argument("--out", help="write a markdown report here")
    p.add_argument("--json", help="write the predictions and the correlation here")
    return p


def _read_json(path: str, flag: str, writer: str):
    """The JSON document in ``path`` (the value of ``flag``). Raises OSError when it cannot be read
    and ValueError (one line naming the flag, the file and ``writer``, the command that writes
    such files) when it is not JSON -- e.g. a file cut short by a full disk or a killed run."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise ValueError(f"{flag} {path!r} is not valid JSON ({str(e).splitlines()[0]}); pass a file '{writer}' "
                         "wrote") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0, or 2 on a usage or input error (message on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        check_out_files({"--json": args.json, "--out": args.out})
        rows = _read_json(args.bench_train, "--bench-train", "zerotron bench train --json")
        comm_bench = _read_json(args.bench_comm, "--bench-comm", "zerotron bench comm --json")
        if not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
            raise ValueError(f"--bench-train {args.bench_train!r} is not a 'zerotron bench train --json' file "
                             "(a list of layout records)")
        if not (isinstance(comm_bench, dict) and isinstance(comm_bench.get("results"), list)
                and all(isinstance(r, dict) for r in comm_bench["results"])
                and isinstance(comm_bench.get("topology", {}), dict)):
            raise ValueError(f"--bench-comm {args.bench_comm!r} is not a 'zerotron bench comm --json' file "
                             "(an object with a list of results)")
        cfg, global_batch = _model_from_args(argparse.Namespace(model=None, config=args.config))
        micro_batch = load_config(args.config).train.micro_batch
        ran = [r for r in rows if not r.get("skipped")]
        if not ran:
            raise ValueError("the bench train file has no measured layout")
        if any(str(r.get("peak_mem_kind", "")).startswith("cuda") for r in ran):
            raise ValueError("bench plan builds its hardware profile from CPU micro-benchmarks, so it validates "
                             "CPU (gloo) bench train runs only; for GPUs use 'zerotron plan --calibrate' and compare "
                             "its ranking with the bench train table by hand")
        n_params = gpt_num_params(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.bias)
        if ran[0]["num_params"] != n_params or ran[0]["tokens_per_step"] != global_batch * cfg.block_size:
            raise ValueError(f"--config does not match the bench run: {n_params:,} parameters and "
                             f"{global_batch * cfg.block_size} tokens/step vs {ran[0]['num_params']:,} and "
                             f"{ran[0]['tokens_per_step']}")
        threads = args.threads or int(ran[0].get("threads", 1))
        if args.profile:
            prof = _read_json(args.profile, "--profile", "zerotron bench plan --json")
            if not isinstance(prof, dict) or not isinstance(prof.get("profile"), dict):
                raise ValueError(f"--profile {args.profile!r} has no 'profile' object; pass a file "
                                 "'zerotron bench plan --json' wrote")
            prof = dict(prof["profile"])
            if args.peak_flops:
                prof["peak_flops"] = args.peak_flops
        else:
            prof = measure_profile(cfg, micro_batch, threads, args.peak_flops)
        if args.compute_eff:
            prof["compute_eff"] = args.compute_eff
        peak = prof["peak_flops"]
        how = ("given (--peak-flops)" if args.peak_flops else f"from {args.profile}" if args.profile else
               f"measured now: best of 10 fp32 1024^3 matmuls, {threads} thread(s)")
        memory = physical_bytes()
        hw, comm_world, nodes = cpu_hardware(comm_bench, peak, memory, prof["vector_rate"])
        preds = predict(rows, cfg, global_batch, micro_batch, hw, prof["compute_eff"], launch_s=prof["launch_s"],
                        nodes=nodes)
        if len(preds) < 3:
            raise ValueError(f"only {len(preds)} measured layout(s) of the bench train file have a planner "
                             "counterpart; a rank correlation needs >= 3 (see planner_layout)")
        if args.trace:
            trace_predictions(preds, args.config, hw, prof["compute_eff"], prof["launch_s"])
        rhos = correlations(preds)
    except KeyError as e:
        print(f"zerotron bench plan: error: field {e} missing from a record of {args.bench_train!r}; pass a file "
              "written by 'zerotron bench train --json'", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"zerotron bench plan: error: cannot read {e.filename!r} ({e.strerror}); pass the files that "
              "'zerotron bench train --json' and 'zerotron bench comm --json' wrote", file=sys.stderr)
        return 2
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        print(f"zerotron bench plan: error: {e}", file=sys.stderr)
        return 2
    table = format_table(preds)
    rho = rhos["all"]
    verdict = "met" if rho >= GOAL else "NOT met"
    summary = (f"Spearman rank correlation (predicted vs measured median tokens/s, {len(preds)} layouts): "
               f"{rho:.3f} (goal >= {GOAL}: {verdict})")
    others = [f"{rhos['same_world_layouts']} layouts on {rhos['same_world_size']} ranks only: "
              f"{_f3(rhos['same_world'])}"]
    if rhos.get("base_layouts") is not None:
        others.append(f"{rhos['base_layouts_n']} strategy layouts without -mb/-ac variants: {rhos['base_layouts']:.3f}")
    if "best_round" in rhos:
        others.append(f"vs the best round's tokens/s: {rhos['best_round']:.3f}")
    if "trace" in rhos:
        others.append(f"the dry-run trace's prediction over the {rhos['trace_n']} layouts it traced: "
                      f"{rhos['trace']:.3f} (the formula on the same layouts: {rhos['formula_on_traced']:.3f})")
    summary2 = "Also: " + "; ".join(others)
    print(f"{table}\n{summary}\n{summary2}")
    busbw = ", ".join(f"{op} {hw.intra[op] / 1e9:.3f} GB/s + {hw.latency_intra[op] * 1e6:.0f} us" for op in OPS)
    if args.json:
        write_out_file(args.json, json.dumps({
            "spearman": rho, "spearman_variants": rhos, "goal": GOAL, "layouts": preds,
            "hardware": {"name": hw.name, "peak_flops": peak, "peak_flops_how": how, "memory": hw.memory,
                         "busbw_GBps": {op: hw.intra[op] / 1e9 for op in OPS},
                         "latency_us": {op: hw.latency_intra[op] * 1e6 for op in OPS}, "overlap": hw.overlap,
                         "sync_penalty_us": hw.sync_penalty * 1e6,
                         "vector_rate_per_s": hw.vector_rate, "comm_world_size": comm_world},
            "profile": prof, "compute_eff": prof["compute_eff"], "elem_bytes": 4, "global_batch": global_batch,
            "micro_batch": micro_batch, "seq": cfg.block_size, "bench_train": args.bench_train,
            "bench_comm": args.bench_comm}, indent=1))
    if args.out:
        cmd = "zerotron bench plan " + " ".join(argv if argv is not None else sys.argv[1:])
        write_out_file(args.out, "\n".join([
            "# Planner validation: predicted vs measured training throughput", "", f"Command: `{cmd}`", "",
            f"Hardware profile \"cpu\", measured on this machine: peak {peak / 1e9:.2f} GFLOP/s per rank ({how}); "
            f"compute_eff {prof['compute_eff']:.3f} (the model's MLP matmul / peak); vector rate "
            f"{hw.vector_rate / 1e9:.3f} G element passes/s (GELU + log-softmax, forward + backward); per-layer "
            f"overhead {prof['launch_s'] * 1e6:.0f} us (one block on one token); collectives fitted (alpha + "
            f"bytes/busbw) to `{args.bench_comm}` ({comm_world} ranks): {busbw}; + {hw.sync_penalty * 1e6:.0f} us per "
            f"collective that follows compute (its after_compute all-reduce); dp overlap {hw.overlap:.2f} (its overlap test); fp32 communication (4 bytes/element); " + ("all ranks on one node." if nodes == 1 else
            f"{nodes} nodes, the inter-node link fitted to its inter results: " + ", ".join(
                f"{op} {hw.inter[op] / 1e9:.4f} GB/s" for op in OPS) + "."), "",
            f"Model: {n_params:,} parameters, global batch {global_batch} x seq {cfg.block_size}, micro-batch "
            f"{micro_batch}; measured: `{args.bench_train}`.", "", table, "", f"**{summary}.**", "", summary2 + ".", "",
            "Ranks: 1 = fastest (ties averaged). predicted compute ms = matmuls + elementwise (vector) + per-layer "
            "overhead; "
            "comm = dp + tp + pp communication; bubble = the pipeline bubble term. Method: "
            "zerotron/bench/validate_plan.py.", ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
