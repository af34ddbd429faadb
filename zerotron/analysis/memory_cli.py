"""``zerotron memory``: the ZeRO model-state table per data-parallel rank
(:mod:`zerotron.analysis.memory`), with ``--model`` and ``--seq`` the activations per pipeline rank
(:mod:`zerotron.analysis.activations`), with ``--ep`` a mixture-of-experts model's expert states and
all-to-all bytes (:mod:`zerotron.analysis.moe_memory`). Entry point :func:`memory_main`."""
from __future__ import annotations

import argparse
import json
import math
import sys

from zerotron.analysis.activations import (
    ATTENTION,
    RECOMPUTE,
    SCHEDULES,
    activation_bytes,
    looped_counts,
    stage_layer_counts,
)
from zerotron.analysis.bubble import NCCL_REFUSED, bubble_fraction, pipeline_idle
from zerotron.analysis.flops import shape_of
from zerotron.analysis.memory import (
    DTYPES,
    GB,
    OFFLOADS,
    OPTIMIZERS,
    STAGES,
    format_table,
    model_state_bytes,
    preset_config,
    preset_num_params,
    stage_num_params,
    zero_table,
)
from zerotron.analysis.moe_memory import moe_estimate
from zerotron.models.layout import tp_refusal
from zerotron.plan import CHUNKED_SCHEDULES


def _count(text: str) -> int:
    """argparse type: a positive integer count, also written like 7e9 or 7_000_000_000."""
    try:
        value = float(text.replace("_", "")) if any(c in text for c in ".eE") else int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 1 or value != int(value):  # 1e400 is inf: int() would raise
        raise argparse.ArgumentTypeError(f"must be a positive integer (a parameter count like 7e9), got {text!r}")
    return int(value)


def _chunks(args) -> int:
    """Model stages per pipeline rank of the --schedule: --virtual-stages for interleaved and zb-v."""
    return args.virtual_stages if args.schedule in CHUNKED_SCHEDULES else 1


def _rank_params(cfg, args) -> list[int]:
    """Parameters per pipeline rank of the CLI's layout (zb-v: rank r holds stages r and 2pp-1-r)."""
    v = _chunks(args)
    if v * args.pp > shape_of(cfg).n_layer:
        return stage_num_params(cfg, args.tp, args.pp, v)  # (its error names pp * virtual_stages)
    counts = looped_counts(stage_layer_counts(shape_of(cfg).n_layer, args.pp * v), args.pp, args.schedule)
    return stage_num_params(cfg, args.tp, args.pp, v, counts)


def _add_activation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activations (Korthikanti et al. 2022; need --model and --seq)")
    g.add_argument("--seq", type=int, help="sequence length S (tokens)")
    g.add_argument("--micro-batch", type=int, default=1, help="micro-batch size b (sequences)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (with tp)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree (parallel.cp): each rank holds seq/cp tokens; ZeRO shards over dp x cp")
    g.add_argument("--schedule", "--pp-schedule", dest="schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (parallel.pp_schedule); zb-v needs --virtual-stages 2 and gloo")
    g.add_argument("--microbatches", type=int, help="micro-batches per pipeline flush (default pp)")
    g.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (interleaved, zb-v: 2)")
    g.add_argument("--recompute", default="none", choices=RECOMPUTE, help="activation checkpointing")
    g.add_argument("--attention", default="math", choices=ATTENTION,
                   help="math: the paper's s^2 softmax term; flash: none")


def _activation_report(args, num_params: int) -> tuple[dict, list]:
    """(activations object, rows with model states of the largest pipeline rank + activations)."""
    cfg = preset_config(args.model)
    kind = args.schedule
    v = _chunks(args)
    m = args.microbatches or args.pp
    # context parallelism: every layer works on this rank's seq/cp tokens (attention as the ring's
    # per-step blocks of (seq/cp)^2 scores; the all-gather implementation also keeps the full K and V)
    act = activation_bytes(cfg, args.micro_batch, args.seq // args.cp, tp=args.tp, sp=args.sp, pp=args.pp,
                           schedule=kind, microbatches=m, virtual_stages=v,
                           recompute=args.recompute, dtype="fp32" if args.dtype == "fp32" else "bf16",
                           attention=args.attention)
    params = _rank_params(cfg, args)
    rows = []
    for stage in STAGES:
        per_rank = [model_state_bytes(p, args.dp * args.cp, stage, args.dtype, args.optimizer,
                                      args.dp_replicate)["total_bytes"]
                    for p in params]
        totals = [s + a for s, a in zip(per_rank, act["per_rank_bytes"])]
        r = max(range(len(totals)), key=lambda i: (totals[i], -i))
        rows.append({"stage": stage, "rank": r, "model_state_bytes": per_rank[r],
                     "activation_bytes": act["per_rank_bytes"][r], "total_bytes": totals[r]})
    kv = shape_of(cfg).kv_cache_bytes(args.micro_batch, args.seq, 4 if args.dtype == "fp32" else 2, args.tp)
    # bubble of one flush at uniform stages, T_F = T_B = T_W (zerotron schedule --w-cost 1)
    idle = pipeline_idle(args.pp, m, "1f1b" if kind == "naive" else kind, v) if args.pp > 1 else 0.0
    inputs = {"seq": args.seq, "cp": args.cp, "micro_batch": args.micro_batch, "tp": args.tp, "sp": args.sp,
              "pp": args.pp, "schedule": kind, "microbatches": m, "virtual_stages": v,
              "recompute": args.recompute, "attention": args.attention,
              "params_per_rank": params, "kv_cache_bytes": kv,
              "bubble_fraction": bubble_fraction(args.pp, m, "1f1b" if kind == "naive" else kind, v)
              if args.pp > 1 else 0.0, "idle_per_rank_t_f": idle,
              "gloo_only": kind in NCCL_REFUSED}
    return {**inputs, **act, "totals": rows}, rows


def memory_main(argv: list) -> int:
    """``zerotron memory [--model PRESET | --params N] --dp N [--dtype fp32|bf16-mixed]
    [--optimizer adam|sgd] [--json]``: print the ZeRO stage 0..3 model-state table (GB per rank)
    or, with ``--json``, ``{"num_params", "dp", "dtype", "optimizer", "stages": [rows in bytes]}``.

    Activation options (need ``--model``): ``--seq S [--micro-batch B] [--tp T] [--pp P] [--sp] [--cp C]
    [--schedule K] [--microbatches M] [--virtual-stages V] [--recompute none|selective|full]
    [--attention math|flash]`` add the activation bytes per pipeline rank
    (:func:`zerotron.analysis.activations.activation_bytes`, activations in fp32 for ``--dtype fp32``,
    bf16 for bf16-mixed) and per ZeRO stage a total = model states + activations of the worst
    pipeline rank; ``--json`` adds an ``"activations"`` object. With tp or pp > 1 the model-state
    rows are for the largest rank's parameters (:func:`stage_num_params`). ``--cp C`` (context
    parallelism): activations of seq / C tokens per rank, model states sharded over dp x C.
    Returns 0 on success, 2 on a usage or value error (message on stderr)."""
    parser = memory_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or the parser printed its one-line error on stderr
        return 0 if exc.code in (0, None) else 2
    return _memory_run(args)


def memory_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron memory``."""
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    parser = OneLineErrorParser(prog="zerotron memory", formatter_class=HelpFormatter,
                                     description="ZeRO model-state bytes per data-parallel rank.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model preset name, GPT-2 or Llama (e.g. gpt2, llama3-8b)")
    src.add_argument("--params", type=_count, help="parameter count, e.g. 7e9")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel degree N")
    parser.add_argument("--dp-replicate", type=int, default=1,
                        help="HSDP replicas R (parallel.dp_replicate): state sharded over N/R ranks")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="training precision")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS, help="optimizer (its state bytes)")
    parser.add_argument("--offload", default="none", choices=OFFLOADS,
                        help="train.offload: optimizer = master shards and optimizer state in host memory, "
                             "optimizer-disk = in files on disk (stages 1-3), params = optimizer plus the parameter "
                             "shards at rest on the host (stage 3)")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    parser.add_argument("--ep", type=int, default=1, help="mixture-of-experts models: expert-parallel degree "
                        "(experts split over ep, carved out of dp x cp); prints total vs active parameters, expert "
                        "memory per rank and all-to-all bytes per step (with --seq and --global-batch)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per optimizer step (MoE all-to-all bytes; default dp x micro-batch)")
    _add_activation_args(parser)
    return parser


def _moe_report(args) -> dict | None:
    """:func:`moe_estimate` for the CLI's --model (None for a dense one with --ep 1)."""
    cfg = preset_config(args.model) if args.model else None
    if cfg is None or not getattr(cfg, "n_experts", 0):
        if args.ep != 1:
            raise ValueError(f"--ep {args.ep} splits the experts of a mixture-of-experts --model; this one has none")
        return None
    if args.global_batch is not None and args.global_batch % (args.dp * args.micro_batch):
        raise ValueError(f"--global-batch {args.global_batch} must be a multiple of --dp x --micro-batch")
    m = (args.global_batch // (args.dp * args.micro_batch)) if args.global_batch else 1
    layout = dict(cp=args.cp, dp_replicate=args.dp_replicate, tp=args.tp, sp=args.sp, pp=args.pp,
                  schedule=args.schedule, virtual_stages=_chunks(args), recompute=args.recompute)
    out = moe_estimate(cfg, args.dp, args.ep, 0, args.dtype, args.optimizer, args.seq, args.micro_batch, m, **layout)
    top = max(out["pipeline_ranks"], key=lambda r: r["states"][0]["total_bytes"])  # the rank reported above
    out["dense_state_bytes_zero1"] = top["states"][1]["dense_state_bytes"]
    return out


def _memory_run(args) -> int:
    try:
        for name, value, low in (("--pp", args.pp, 1), ("--virtual-stages", args.virtual_stages, 1),
                                 ("--microbatches", args.microbatches, 0)):
            if value is not None and value < low:  # this command's option names, not the estimator's
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if args.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {args.cp}")
        if args.cp > 1 and args.seq is not None and args.seq % (2 * args.cp):  # cp 1: no zigzag split
            raise ValueError(f"--seq {args.seq} is not divisible by 2*cp = {2 * args.cp} (each cp rank holds two "
                             "zigzag chunks of the sequence); change --seq or --cp")
        if args.cp > 1 and args.seq is None and args.model and preset_config(args.model).block_size % (2 * args.cp):
            # without --seq the sequence is the preset's block_size (training refuses the same cp)
            raise ValueError(f"--cp {args.cp} needs the sequence, {args.model}'s block_size "
                             f"{preset_config(args.model).block_size} without --seq, divisible by 2*cp = "
                             f"{2 * args.cp} (each cp rank holds two zigzag chunks); pass --seq or change --cp")
        if (args.seq is not None or args.tp != 1 or args.pp != 1) and not args.model:
            raise ValueError("--seq, --tp and --pp need a model shape: use --model PRESET")
        if args.model:  # the tensor-parallel rule, with this command's option names
            reason = tp_refusal(args.tp, shape_of(preset_config(args.model)).tp_sizes(),
                                args.seq // args.cp if args.sp and args.seq is not None else None,
                                tp_name="--tp", seq_name="--seq", sp_name="--sp")
            if reason:
                raise ValueError(reason)
        num_params = preset_num_params(args.model) if args.model else args.params
        rank_params = num_params
        if args.model and (args.tp != 1 or args.pp != 1):
            rank_params = max(_rank_params(preset_config(args.model), args))
        rows = zero_table(rank_params, args.dp * args.cp, args.dtype, args.optimizer, args.dp_replicate, args.offload)
        act, act_rows = _activation_report(args, num_params) if args.seq is not None else (None, [])
        moe = _moe_report(args)
    except (ValueError, ImportError) as exc:
        print(f"zerotron memory: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"num_params": num_params, "dp": args.dp, "cp": args.cp, "dp_replicate": args.dp_replicate, "dtype": args.dtype,
               "optimizer": args.optimizer, "offload": args.offload, "stages": rows}
        if act is not None:
            out["activations"] = act
        if moe is not None:
            out["moe"] = moe
        print(json.dumps(out))
        return 0
    hsdp = f" ({args.dp_replicate} replicas x {args.dp // args.dp_replicate} shards)" if args.dp_replicate > 1 else ""
    cp = f", cp={args.cp} (sharded over dp x cp)" if args.cp > 1 else ""
    off = {"none": "", "optimizer": ", offload optimizer (ZeRO-Offload, Ren et al. 2021)",
           "optimizer-disk": ", offload optimizer-disk (ZeRO-Infinity, Rajbhandari et al. 2021)",
           "params": ", offload params + optimizer (ZeRO-Infinity, Rajbhandari et al. 2021; stage 3)"}[args.offload]
    print(f"{num_params:,} parameters, dp={args.dp}{hsdp}{cp}, {args.dtype}, {args.optimizer}{off}: "
          f"model states per rank (ZeRO, Rajbhandari et al. 2020)")
    if rank_params != num_params:
        print(f"largest model-parallel rank (tp={args.tp}, pp={args.pp}): {rank_params:,} parameters")
    print(format_table(rows))
    if moe is not None:
        print(f"mixture of experts: {moe['total_params']:,} parameters, {moe['active_params']:,} active per token; "
              f"training FLOPs per token {moe['flops_per_token']:.4g} (6 x active matmul parameters"
              + (" + attention" if args.seq else "") + f"); ep {args.ep}: {moe['expert_params_per_rank']:,} expert "
              f"parameters per rank, expert params + grads + optimizer {moe['expert_state_bytes'] / GB:.4g} GB, "
              f"dense states over dp x cp {moe['dense_state_bytes'] / GB:.4g} GB (DDP), "
              f"{moe['dense_state_bytes_zero1'] / GB:.4g} GB (ZeRO-1)"
              + (f"; all-to-all {moe['all_to_all_bytes'] / GB:.4g} GB per rank and step" if moe["all_to_all_bytes"] else ""))
    if act is not None:
        print(f"activations (Korthikanti et al. 2022), seq {args.seq}" + (f" / cp {args.cp}" if args.cp > 1 else "") + ", micro-batch "
              f"{args.micro_batch}, tp {args.tp}{' +sp' if args.sp else ''}, pp {args.pp} "
              f"{act['schedule']} m={act['microbatches']}, recompute {args.recompute}, attention "
              f"{args.attention}: {act['per_layer_bytes'] / GB:.4g} GB per layer; per pipeline rank "
              + ", ".join(f"{b / GB:.4g}" for b in act["per_rank_bytes"]) + " GB")
        if args.pp > 1:
            unit = "chunks" if act["virtual_stages"] > 1 else "micro-batches"
            held = "until its W, + captured gradients between B and W" if act["schedule"] in ("zb-h1", "zb-v") \
                else "until its backward"
            print(f"pipeline {act['schedule']}: peak in flight per rank {act['peak_in_flight']} ({unit}, each "
                  f"held {held}); bubble fraction {act['bubble_fraction']:.3f} (idle per rank "
                  f"{act['idle_per_rank_t_f']:.4g} T_F; uniform stages, T_F = T_B = T_W)"
                  + ("; gloo only: the runner refuses zb-v on NCCL" if act["gloo_only"] else ""))
        print(f"{'ZeRO stage':>12}  {'rank':>12}  {'states GB':>12}  {'activ. GB':>12}  "
              f"{'total GB':>12}")
        for r in act_rows:
            print(f"{r['stage']:>12}  {r['rank']:>12}  {r['model_state_bytes'] / GB:>12.4g}  "
                  f"{r['activation_bytes'] / GB:>12.4g}  {r['total_bytes'] / GB:>12.4g}")
        print(f"inference KV cache of {args.micro_batch} x {args.seq} tokens per tp rank: "
              f"{act['kv_cache_bytes'] / GB:.4g} GB (2 x layers x tokens x n_kv_head/tp x head_dim)")
    return 0
