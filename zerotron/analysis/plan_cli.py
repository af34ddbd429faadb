"""Command line of ``zerotron plan`` (the cost model and ranking live in
:mod:`zerotron.analysis.planner`, the hardware profiles in :mod:`zerotron.analysis.hardware`)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.hardware import GB, GPUS, HOST_LINKS, calibrate, hardware
from zerotron.analysis.memory import parse_memory
from zerotron.analysis.planner import plan
from zerotron.config import ConfigError, load_config, model_shape
from zerotron.config_checks import INT64


def _model_from_args(args):
    """(model config of any family, the config's global batch or None) from --model or --config."""
    from zerotron.models.registry import config_from_section, preset_config

    if args.model:
        return preset_config(args.model), None
    try:
        c = load_config(args.config)
        shape = model_shape(c.model)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    vocab = c.model.vocab_size or shape.get("vocab_size") or c.data.vocab_size
    return config_from_section(c.model, vocab), c.train.global_batch


def calibration_mismatch(bench: dict, gpu: str) -> str | None:
    """A one-line warning when a ``bench comm --json`` file was measured on CPU / gloo (its
    ``topology``) but calibrates the intra-node link of GPU ``gpu``; None when it looks like a GPU
    (nccl, cuda) measurement or says nothing about where it ran."""
    topo = bench.get("topology") if isinstance(bench, dict) else None
    topo = topo if isinstance(topo, dict) else {}
    backend, device = topo.get("backend"), topo.get("device_type")
    if backend == "gloo" or device == "cpu":
        where = " on ".join(str(x) for x in (backend, device) if x)
        return (f"the calibration file was measured with {where}, but the target is {gpu} GPUs: its CPU "
                f"link numbers replace the {gpu} intra-node (NVLink) link; calibrate with 'zerotron bench comm "
                "--backend nccl' on the target machine")
    return None


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron plan", formatter_class=HelpFormatter, description="Rank parallel layouts of a GPT-2 or Llama model "
                                "by predicted memory and step time (zerotron.analysis.planner).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model preset, GPT-2 or Llama (e.g. gpt2, llama3-8b)")
    src.add_argument("--config", help="TOML config ([model] shape, train.global_batch)")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs G")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node K")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU type")
    p.add_argument("--gpu-mem", help="usable memory per GPU, e.g. 80GB (default: the GPU's)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, help="sequence length (default: block_size)")
    p.add_argument("--calibrate", help="'bench comm --json' file: intra-node latency and busbw per op (alpha-beta fit), dp overlap and sync penalty")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--sp", action="store_true", help="sequence parallelism when tp > 1")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                   help="process-group backend: zb-v is proposed on gloo only (the runner refuses it on NCCL)")
    p.add_argument("--attention", default="flash", choices=("flash", "math"),
                   help="flash (SDPA on GPUs): no s^2 activations; math: Korthikanti's count")
    p.add_argument("--compute-eff", type=float, default=0.5, help="achieved/peak FLOP/s")
    p.add_argument("--comm-eff", type=float, default=0.8, help="achieved/datasheet bw")
    p.add_argument("--overhead", default="2GB", help="fixed framework memory per GPU")
    p.add_argument("--host-link", default="none", choices=("none", *HOST_LINKS),
                   help="device-host link for offload (train.offload): layouts that do not fit otherwise are "
                        "priced with optimizer (then, at ZeRO-3, params) offload and its host traffic per step")
    p.add_argument("--supported-only", action="store_true",
                   help="only layouts zerotron's config validation accepts (every layout the planner prices "
                        "today: pipeline x ZeRO-1/2/3 and pipeline x HSDP run)")
    return p


def plan_main(argv: list) -> int:
    """``zerotron plan (--model PRESET | --config F) --gpus G [--gpus-per-node K] [--gpu-mem 80GB]
    --global-batch B [--seq S] [--gpu h100|h200|a100] [--calibrate bench_comm.json] [--top 10]
    [--json] [--sp] [--backend nccl|gloo] [--attention flash|math] [--compute-eff E] [--comm-eff E] [--overhead 2GB]
    [--supported-only]``: the best layouts of :func:`plan` as a table, or with ``--json``
    ``{"layouts": [top ones], "dropped": {reason: count}, "feasible": n, "assumptions": {...}}``.
    Defaults: --seq = block_size, --gpu-mem = the GPU's memory, --global-batch from --config.
    Returns 0, 1 if no layout fits, 2 on a usage or value error (message on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or the parser printed its one-line error on stderr
        return 0 if exc.code in (0, None) else 2
    try:
        cfg, default_batch = _model_from_args(args)
        for name in ("seq", "global_batch"):
            if getattr(args, name) is not None and not 1 <= getattr(args, name) < INT64:  # as the config's ints
                raise ValueError(f"--{name.replace('_', '-')} must be in [1, 2**63), got {getattr(args, name)}")
        batch = args.global_batch or default_batch
        if not batch:
            raise ValueError("--global-batch is required with --model")
        if args.top < 1:
            raise ValueError(f"--top must be >= 1 (layouts to print), got {args.top}")
        if not 0 < args.compute_eff <= 1:
            raise ValueError(f"--compute-eff must be in (0, 1], got {args.compute_eff}")
        if args.gpus >= 1 and args.gpus_per_node >= 1 and args.gpus % args.gpus_per_node:
            raise ValueError(f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({args.gpus_per_node}); "
                             f"on one node of {args.gpus} GPUs pass --gpus-per-node {args.gpus}")
        hw = hardware(args.gpu, args.comm_eff)
        if args.calibrate:
            try:
                with open(args.calibrate) as f:
                    bench = json.load(f)
                hw = calibrate(hw, bench)
            except (OSError, json.JSONDecodeError) as e:  # was the bare "[Errno 2] ..." / "Expecting value: ..."
                why = e.strerror if isinstance(e, OSError) and e.strerror else f"not JSON: {e}"
                raise ValueError(f"cannot read calibration file {args.calibrate!r} ({why}); pass the --json file "
                                 "of 'zerotron bench comm'") from None
            warning = calibration_mismatch(bench, hw.name)
            if warning:
                print(f"zerotron plan: warning: {warning}", file=sys.stderr)
        mem = parse_memory(args.gpu_mem) if args.gpu_mem else hw.memory
        cm = CostModel(hw, args.gpus_per_node, args.compute_eff, parse_memory(args.overhead),
                       args.attention, args.sp, backend=args.backend,
                       host_link=HOST_LINKS.get(args.host_link, 0.0))
        seq = args.seq or cfg.block_size
        res = plan(cfg, args.gpus, mem, batch, seq, cm, args.supported_only)
    except (ValueError, ImportError) as e:
        print(f"zerotron plan: error: {e}", file=sys.stderr)
        return 2
    top = res["layouts"][:args.top]
    assumptions = {**{k: v for k, v in asdict(cm).items() if k != "hw"}, "gpu": hw.name,
                   "peak_flops": hw.peak_flops, "comm_eff": args.comm_eff, "gpu_mem_bytes": mem,
                   "intra_node_busbw_GBps": {k: v / 1e9 for k, v in hw.intra.items()},
                   "inter_node_busbw_GBps": {k: v / 1e9 for k, v in hw.inter.items()},
                   "intra_node_latency_us": {k: v * 1e6 for k, v in hw.latency_intra.items()},
                   "inter_node_latency_us": {k: v * 1e6 for k, v in hw.latency_inter.items()},
                   "vector_rate_per_s": hw.vector_rate, "dp_overlap": hw.overlap,
                   "sync_penalty_us": hw.sync_penalty * 1e6,
                   "calibrated_from": args.calibrate, "seq": seq, "global_batch": batch,
                   "gpus": args.gpus, "precision": "bf16-mixed + Adam (K=12), bf16 activations",
                   "rank_order": "(pp, dp, cp, tp), tp innermost",
                   "overlap": "tp and pp communication on the critical path; a fraction dp_overlap "
                              "of the dp communication hidden behind the backward"}
    if args.json:
        print(json.dumps({"layouts": top, "dropped": res["dropped"],
                          "feasible": len(res["layouts"]), "assumptions": assumptions}))
        return 0 if top else 1
    print(f"zerotron plan: {args.gpus} x {hw.name} ({args.gpus_per_node}/node, {mem / GB:.4g} GB), "
          f"global batch {batch} x seq {seq}: {len(res['layouts'])} layouts fit")
    cols = ("dp", "cp", "tp", "pp", "ep", "zero", "schedule", "micro-b", "recompute", "mem GB", "step s",
            "tokens/s", "MFU")
    print(" ".join(f"{c:>11}" for c in cols))
    for r in top:
        print(" ".join(f"{v:>11}" for v in (
            f"{r['dp']}r{r['dp_replicate']}" if r.get("dp_replicate", 1) > 1 else r["dp"],  # HSDP: R replicas
            r.get("cp", 1), r["tp"], r["pp"], r.get("ep", 1),
            f"{r['zero_stage']}+{r['offload']}" if r.get("offload") else r["zero_stage"], r["schedule"], r["micro_batch"],
            r["recompute"], f"{r['memory_bytes_per_gpu'] / GB:.3f}",
            f"{r['predicted_step_time_s']:.4g}", f"{r['predicted_tokens_per_s']:.4g}",
            f"{r['predicted_mfu']:.3f}")))
    print("dropped: " + ", ".join(f"{k} {v}" for k, v in res["dropped"].items()))
    if args.calibrate:
        print(f"calibrated intra-node link from {args.calibrate}: " + ", ".join(
            f"{op} {hw.latency_intra[op] * 1e6:.0f} us + {hw.intra[op] / 1e9:.3g} GB/s" for op in hw.intra)
            + f"; sync penalty {hw.sync_penalty * 1e6:.0f} us; dp overlap {hw.overlap:.2f}; the inter-node "
            "link keeps the datasheet values")
    if not top:
        print("zerotron plan: no layout fits: add GPUs or memory, or lower the global batch or "
              "sequence length", file=sys.stderr)
    return 0 if top else 1
