"""Command line of ``zerotron dryrun`` (the tracing lives in :mod:`zerotron.analysis.dryrun`)."""
from __future__ import annotations

import json
import sys

from zerotron.analysis.memory import GB, parse_memory
from zerotron.out_files import out_file_refusal, write_out_file


def _parser():
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron dryrun", formatter_class=HelpFormatter,
                           description="Trace one training step of chosen ranks of a layout at any world size in "
                                       "this process (fake tensors, fake process group): peak memory by category "
                                       "and collective bytes per group, beside the estimators'. Config overrides: "
                                       "--section.field VALUE.")
    p.add_argument("--config", help="TOML config (model preset, layout, batch, dtype, recomputation)")
    p.add_argument("--world", type=int, required=True, help="world size N (ranks of the layout)")
    p.add_argument("--rank", type=int, action="append",
                   help="trace this rank (repeatable; default: one per role, the first and last pipeline stage)")
    p.add_argument("--gpu-mem", help="capacity per device for the out-of-memory report, e.g. 80GB")
    p.add_argument("--hardware", default="h100", help="hardware preset the step time is predicted for "
                                                      "(h100, h200, a100: datasheet values)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (which groups cross nodes)")
    p.add_argument("--compute-eff", type=float, default=0.5, help="achieved / peak FLOP/s of the matmuls")
    p.add_argument("--json", dest="json_out", help="write the records as one JSON array to this file ('-': stdout)")
    return p


def _gb(b) -> str:
    return f"{b / GB:.4g}" if b is not None else "-"


def _ratio(r) -> str:
    return f"{r:.3f}" if r is not None else "-"


def print_record(r: dict) -> None:
    """The human-readable report of one record of :func:`zerotron.analysis.dryrun.dry_run`."""
    c = r["coords"]
    at = r["peak_at"] or {}
    print(f"rank {r['rank']} of {r['world']} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']}): traced in "
          f"{r['wall_s']:.1f} s, process max RSS {r['max_rss_bytes'] / 2**30:.2f} GiB")
    print(f"  peak {_gb(r['peak_bytes_traced'])} GB traced vs {_gb(r['peak_bytes_estimated'])} GB estimated "
          f"(ratio {_ratio(r['ratios']['peak'])}) at {at.get('phase')} / {at.get('pass')} / "
          f"{at.get('module') or ('outside the modules (the loss)' if at.get('phase') == 'forward_backward' else '-')}")
    print(f"  construction (model build + parallelize): {_gb(r['construction_bytes'])} GB with train.meta_init "
          f"(held after parallelize + the largest dense tensor), {_gb(r['setup_peak_bytes'])} GB building densely"
          + (" (in use)" if not r.get("meta_init") else ""))
    est = r["estimated"]
    rows = [("parameters", est["model_states"]["params_bytes"]), ("gradients", est["model_states"]["grads_bytes"]),
            ("optimizer", est["model_states"]["optimizer_bytes"]), ("activations", est["activations"]),
            ("temporary", None), ("other", None)]
    print(f"  {'category':>12} {'traced GB':>12} {'estimated GB':>13}")
    for name, e in rows:
        print(f"  {name:>12} {_gb(r['peak_traced'][name]):>12} {_gb(e):>13}")
    ms = r["model_state_bytes"]
    print(f"  model states after the step (strategy's count): {_gb(ms['total_bytes'])} GB vs estimated "
          f"{_gb(est['model_states']['total_bytes'])} GB (ratio {_ratio(r['ratios']['model_states'])})")
    print(f"  {'group':>12} {'traced MB':>12} {'planned MB':>12} {'ratio':>8}  ops")
    for g in sorted(set(r["comm_bytes_traced"]) | set(r["comm_bytes_planned"])):
        t, p = r["comm_bytes_traced"].get(g, 0), r["comm_bytes_planned"].get(g)
        ops = ", ".join(f"{k} {v['bytes'] / 1e6:.4g}" for k, v in r["comm_traced"].get(g, {}).get("ops", {}).items())
        planned = f"{p / 1e6:.4g}" if p is not None else "-"
        print(f"  {g:>12} {t / 1e6:>12.4g} {planned:>12} "
              f"{_ratio(r['ratios']['comm'].get(g)):>8}  {ops}")
    if r.get("flops_traced") is not None:
        f = r.get("flops_formula")
        print(f"  FLOPs of the step (matmuls + attention): {r['flops_traced']:.4g} traced"
              + (f" vs {f:.4g} by 6W + 12hS per token and layer (ratio {_ratio(r['ratios']['flops'])})" if f else "")
              + f"; {r['counts_traced']['element_passes']:.4g} element passes, {r['counts_traced']['ops']} ops")
    if r["gpu_mem"] is not None:
        o = r["oom"]
        print(f"  out of memory at {_gb(r['gpu_mem'])} GB: " + (
            f"yes, in {o['phase']} / {o['pass']} / {o['module']}: {o['category']} grew past it "
            f"({_gb(o['total_bytes'])} GB)" if o else "no"))


def print_step_time(st: dict) -> None:
    """The step-time lines of :func:`zerotron.analysis.dryrun.predict_step_time`'s dict."""
    tr, fo = st["trace"], st["formula"]
    parts = ", ".join(f"{k} {v * 1e3:.4g}" for k, v in tr["breakdown_s"].items())
    print(f"step time on {st['hardware']} ({st['gpus_per_node']} per node, compute_eff {st['compute_eff']}): "
          f"{tr['step_s'] * 1e3:.4g} ms from the trace ({parts} ms)"
          + (f"; stages {tr['estimated_stages']} scaled from a traced one" if tr["estimated_stages"] else ""))
    if fo:
        parts = ", ".join(f"{k} {v * 1e3:.4g}" for k, v in fo["breakdown_s"].items())
        print(f"  vs {fo['step_s'] * 1e3:.4g} ms by the planner's formula ({parts} ms): trace / formula "
              f"{_ratio(st['ratio'])}")


def dryrun_main(argv: list) -> int:
    """``zerotron dryrun --config FILE --world N [--rank R ...] [--gpu-mem 80GB] [--hardware h100]
    [--gpus-per-node 8] [--compute-eff 0.5] [--json OUT] [--section.field VALUE ...]``: :func:`zerotron.analysis.dryrun.dry_run`, printed per rank, and
    with ``--json`` the records as one JSON array. Returns 0; 1 if a traced rank runs out of memory
    under ``--gpu-mem``; 2 on a usage or config error (one line on stderr)."""
    from zerotron.analysis.dryrun import DryRunError, dry_run
    from zerotron.analysis.hardware import hardware
    from zerotron.config import ConfigError, load_config, parse_overrides

    try:
        args, rest = _parser().parse_known_args(argv)
    except SystemExit as exc:
        return 0 if exc.code in (0, None) else 2
    try:
        if args.world < 1:
            raise DryRunError(f"--world must be >= 1, got {args.world}")
        out = args.json_out
        refusal = out_file_refusal(out if out != "-" else None, "--json", "dry.json")  # before the trace (minutes)
        if refusal:
            raise DryRunError(refusal)
        cfg = load_config(args.config, parse_overrides(rest))
        gpu_mem = parse_memory(args.gpu_mem) if args.gpu_mem else None
        if args.gpus_per_node < 1:
            raise DryRunError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        if args.world > args.gpus_per_node and args.world % args.gpus_per_node:  # as `zerotron plan` refuses it
            raise DryRunError(f"--world ({args.world}) must be a multiple of --gpus-per-node ({args.gpus_per_node}): "
                              "the nodes are whole; pass the ranks each node really has")
        if not 0 < args.compute_eff <= 1:
            raise DryRunError(f"--compute-eff must be in (0, 1], got {args.compute_eff}")
        hw = hardware(args.hardware)
        records = dry_run(cfg, args.world, args.rank, gpu_mem, hw=hw, gpus_per_node=args.gpus_per_node,
                          compute_eff=args.compute_eff)
    except (DryRunError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"zerotron dryrun: error: {e}", file=sys.stderr)
        return 2
    if args.json_out == "-":
        print(json.dumps(records))
    else:
        for r in records:
            print_record(r)
        print_step_time(records[0]["step_time"])
        if args.json_out:
            write_out_file(args.json_out, json.dumps(records, indent=1))
    return 1 if any(r["oom"] for r in records) else 0
