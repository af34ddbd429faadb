"""``zerotron plan``: rank (dp, tp, pp, ZeRO stage, schedule, micro-batch, recompute) layouts of a
GPT on G GPUs by predicted memory and step time. Pure arithmetic: nothing is allocated.

Memory per GPU (bytes), max over pipeline ranks = model states (ZeRO paper, bf16-mixed + Adam,
K = 12, on that rank's parameters per tp rank: ``memory.stage_num_params``) + activations
(``activations.activation_bytes``, bf16, Korthikanti et al. 2022) + a fixed framework overhead
(CUDA context, NCCL buffers, allocator slack: 2 GB, ``--overhead``). Not counted: ZeRO-3's
gathered layer, temporaries, fragmentation beyond the overhead.

Step time (seconds), after Narayanan et al. 2021 (Megatron-LM, PTD-P) section 3:
* compute per micro-batch on pipeline rank r = its FLOPs / (peak FLOP/s x ``compute_eff``):
  per token and layer 72h^2 + 12hS (6 x 12h^2 weights + attention, PaLM appendix B), the output
  layer 6hV on the last stage, divided by tp; recomputation adds one forward: full 24h^2 + 4hS,
  selective 4hS (the attention score/value matmuls) per token and layer.
* tp: per layer and micro-batch 4 all-reduces of b*S*h*2 bytes (2 forward, 2 backward; 6 with full
  recompute); with SP each becomes an all-gather + a reduce-scatter (same bus bytes). Not overlapped.
* pp: per micro-batch and chunk one activation (forward) and one gradient (backward) of b*S*h*2
  bytes (/tp with SP) over the pp link. Not overlapped.
* pipeline: step = m x max_r(stage time) / (1 - bubble), bubble = (p-1)/(v*m + p-1)
  (:func:`zerotron.parallel.schedules.bubble_theory`; v = 2 for interleaved).
* dp, after the pipeline drains (not overlapped: an upper bound), on 2-byte gradients/parameters
  of the largest rank (Psi_r): ZeRO-0/1 one all-reduce per step (2 x 2Psi_r(d-1)/d bus bytes);
  ZeRO-2 a reduce-scatter per micro-batch + one parameter all-gather; ZeRO-3 per micro-batch two
  parameter all-gathers + one reduce-scatter (the ZeRO paper's 1.5x of plain DP, per micro-batch).
  A collective of X bytes on n ranks takes X x factor / busbw (nccl-tests: factor 2(n-1)/n for
  all-reduce, (n-1)/n for all-gather / reduce-scatter, 1 for p2p).
* a per-layer, per-micro-batch launch overhead (``launch_s``, 20 us), so larger micro-batches win.
Links: ranks are ordered (pp, dp, tp), tp innermost, nodes hold ``gpus_per_node`` consecutive
ranks. A group uses the intra-node link (NVLink) iff it fits in aligned node-local blocks, else the
inter-node link (one NIC per GPU). Bandwidths: datasheet x ``comm_eff`` (``GPUS``), or, with
``--calibrate``, the measured busbw of a ``zerotron bench comm --json`` file (largest size per op)
for the intra-node link. MFU = (6N + 12LhS) x tokens / (step time x G x peak FLOP/s).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from itertools import product
from types import SimpleNamespace

from zerotron.analysis.activations import activation_bytes, stage_layer_counts
from zerotron.analysis.flops import gpt_num_params
from zerotron.analysis.memory import model_state_bytes, parse_memory, stage_num_params
from zerotron.parallel.schedules import bubble_theory

GB = 10**9
OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
# Datasheet numbers: dense bf16 peak FLOP/s; NVLink bytes/s per direction (H100/H200 NVLink4 900
# GB/s, A100 NVLink3 600 GB/s, both directions); one 400 Gb/s (NDR) / 200 Gb/s (HDR) NIC per GPU.
GPUS = {
    "h100": dict(peak_flops=989e12, memory=80 * GB, nvlink=450e9, network=50e9),
    "h200": dict(peak_flops=989e12, memory=141 * GB, nvlink=450e9, network=50e9),
    "a100": dict(peak_flops=312e12, memory=80 * GB, nvlink=300e9, network=25e9),
}
SCHEDULE_ORDER = ("none", "1f1b", "interleaved", "gpipe")
RECOMPUTE_ORDER = ("none", "selective", "full")
_SHAPE = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "dropout")


@dataclass(frozen=True)
class Hardware:
    """Peak FLOP/s and memory (bytes) of one GPU; achievable busbw (bytes/s) per op (``OPS``) on
    the intra-node and inter-node links."""
    name: str
    peak_flops: float
    memory: int
    intra: dict = field(hash=False)
    inter: dict = field(hash=False)


def hardware(gpu: str = "h100", comm_eff: float = 0.8) -> Hardware:
    """Datasheet :class:`Hardware` of ``gpu`` (a key of ``GPUS``), bandwidths x ``comm_eff``.
    Raises ValueError for an unknown GPU or comm_eff not in (0, 1]."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if not 0 < comm_eff <= 1:
        raise ValueError(f"comm efficiency must be in (0, 1], got {comm_eff}")
    g = GPUS[gpu]
    return Hardware(gpu, g["peak_flops"], g["memory"], {op: g["nvlink"] * comm_eff for op in OPS},
                    {op: g["network"] * comm_eff for op in OPS})


def custom_hardware(name: str, peak_flops: float, memory: int, busbw: float) -> Hardware:
    """:class:`Hardware` not in ``GPUS`` (e.g. "cpu": a *measured* per-process matmul peak, RAM):
    ``peak_flops`` FLOP/s and ``memory`` bytes per device, ``busbw`` bytes/s for every op on both
    links (refine the intra-node one with :func:`calibrate`). Raises ValueError unless all > 0."""
    if not (peak_flops > 0 and memory > 0 and busbw > 0):
        raise ValueError(f"peak_flops, memory and busbw must be > 0, got {peak_flops}, {memory}, {busbw}")
    return Hardware(name, float(peak_flops), int(memory), dict.fromkeys(OPS, float(busbw)),
                    dict.fromkeys(OPS, float(busbw)))


def calibrate(hw: Hardware, bench: dict) -> Hardware:
    """``hw`` with the intra-node busbw of each op found in ``bench`` (a ``zerotron bench comm
    --json`` dict) replaced by the measured busbw at its largest size (blocking mode preferred),
    GB/s x 1e9. Raises ValueError if ``bench`` has no usable result."""
    best: dict = {}
    for r in bench.get("results", []) if isinstance(bench, dict) else []:
        if isinstance(r, dict) and r.get("op") in OPS and r.get("busbw_GBps", 0) > 0:
            key = (r.get("mode", "blocking") == "blocking", r.get("bytes", 0))
            if r["op"] not in best or key > best[r["op"]][0]:
                best[r["op"]] = (key, r["busbw_GBps"] * 1e9)
    if not best:
        raise ValueError("calibration file has no busbw results for any of " + ", ".join(OPS))
    return replace(hw, intra={**hw.intra, **{op: bw for op, (_, bw) in best.items()}})


@dataclass(frozen=True)
class CostModel:
    """Options of the cost model (module docstring): hardware, ``gpus_per_node``, achieved/peak
    FLOP/s ``compute_eff``, framework ``overhead`` bytes per GPU, ``attention`` kernel ("flash":
    SDPA on GPUs, no s^2 activations; "math": Korthikanti's count), sequence parallelism ``sp``
    whenever tp > 1, ``launch_s`` seconds per layer and micro-batch, and ``elem_bytes`` per
    communicated activation/gradient element (2: bf16; 4: fp32 training, e.g. on CPU). Memory
    is always priced in bf16-mixed (module docstring)."""
    hw: Hardware
    gpus_per_node: int = 8
    compute_eff: float = 0.5
    overhead: int = 2 * GB
    attention: str = "flash"
    sp: bool = False
    launch_s: float = 20e-6
    elem_bytes: int = 2


def _time(nbytes: float, op: str, n: int, bw: dict) -> float:
    factor = {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(op, (n - 1) / n)
    return 0.0 if n == 1 else nbytes * factor / bw[op]


@lru_cache(maxsize=4096)
def _activations(shape: tuple, *args) -> dict:
    b, seq, tp, sp, pp, kind, m, v, recompute, attention = args
    return activation_bytes(SimpleNamespace(**dict(zip(_SHAPE, shape))), b, seq, tp=tp, sp=sp,
                            pp=pp, schedule="1f1b" if kind == "none" else kind, microbatches=m,
                            virtual_stages=v, recompute=recompute, dtype="bf16",
                            attention=attention)


def evaluate(cfg, layout: dict, seq: int, global_batch: int, cm: CostModel) -> dict:
    """Predicted memory and step time of ``layout`` (keys dp, tp, pp, zero_stage, schedule
    ("none" for pp = 1), micro_batch, recompute) for GPT ``cfg``, ``global_batch`` sequences of
    ``seq`` tokens per step (cost model of the module docstring). Returns the layout plus
    ``microbatches``, ``virtual_stages``, ``sp``, ``memory_bytes_per_gpu`` (bytes),
    ``predicted_step_time_s``, ``predicted_tokens_per_s``, ``predicted_mfu`` and
    ``time_breakdown_s`` (seconds per step). Raises ValueError (from the estimators) for an
    impossible layout."""
    dp, tp, pp, b, z = (layout[k] for k in ("dp", "tp", "pp", "micro_batch", "zero_stage"))
    kind, rec, hw, K, sp = layout["schedule"], layout["recompute"], cm.hw, cm.gpus_per_node, cm.sp
    v = 2 if kind == "interleaved" else 1
    m = global_batch // (dp * b)
    h, L, V, S = cfg.n_embd, cfg.n_layer, cfg.vocab_size, seq
    act = _activations(tuple(getattr(cfg, k) for k in _SHAPE), b, S, tp, sp, pp, kind, m, v, rec,
                       cm.attention)
    params = stage_num_params(cfg, tp, pp, v)
    mem = max(model_state_bytes(p, dp, z, "bf16-mixed", "adam")["total_bytes"] + a
              for p, a in zip(params, act["per_rank_bytes"])) + cm.overhead
    counts = stage_layer_counts(L, pp * v)
    tp_bw = hw.intra if tp <= K and K % tp == 0 else hw.inter
    dp_bw = hw.intra if dp * tp <= K and K % (dp * tp) == 0 else hw.inter
    pp_bw = hw.intra if dp * tp * pp <= K else hw.inter
    extra = {"none": 0, "selective": 4 * h * S, "full": 24 * h * h + 4 * h * S}[rec]
    x = b * S * h * cm.elem_bytes  # bytes of one (b, S, h) activation (bf16 by default)
    n_coll = 6 if rec == "full" else 4
    stage, parts = -1.0, {}
    for r in range(pp):
        layers = sum(counts[c * pp + r] for c in range(v))
        flops = b * S * (layers * (72 * h * h + 12 * h * S + extra)
                         + (6 * h * V if r == pp - 1 else 0)) / tp
        t = {"compute": flops / (hw.peak_flops * cm.compute_eff), "overhead": layers * cm.launch_s,
             "pp_comm": 2 * v * _time(x / tp if sp else x, "p2p", 2 if pp > 1 else 1, pp_bw)}
        t["tp_comm"] = layers * n_coll * (
            _time(x, "all_gather", tp, tp_bw) + _time(x, "reduce_scatter", tp, tp_bw) if sp
            else _time(x, "all_reduce", tp, tp_bw))
        if sum(t.values()) > stage:
            stage, parts = sum(t.values()), t
    pipe = m * stage / (1 - bubble_theory(pp, m, v))
    grad = cm.elem_bytes * max(params)
    ag, rs = _time(grad, "all_gather", dp, dp_bw), _time(grad, "reduce_scatter", dp, dp_bw)
    t_dp = (_time(grad, "all_reduce", dp, dp_bw) if z <= 1 else m * rs + ag if z == 2
            else m * (2 * ag + rs))
    step = pipe + t_dp
    tokens = global_batch * S
    model_flops = (6 * gpt_num_params(L, cfg.n_head, h, V, cfg.block_size, bias=cfg.bias)
                   + 12 * L * h * S) * tokens
    breakdown = {k: m * val for k, val in parts.items()}
    breakdown.update(bubble=pipe - m * stage, dp_comm=t_dp)
    return {**layout, "microbatches": m, "virtual_stages": v, "sp": bool(sp and tp > 1),
            "memory_bytes_per_gpu": int(mem), "predicted_step_time_s": step,
            "predicted_tokens_per_s": tokens / step,
            "predicted_mfu": model_flops / (step * dp * tp * pp * hw.peak_flops),
            "time_breakdown_s": breakdown}


def _rank_key(r: dict) -> tuple:
    return (r["predicted_step_time_s"], r["memory_bytes_per_gpu"], r["pp"], r["tp"],
            r["zero_stage"], SCHEDULE_ORDER.index(r["schedule"]), -r["micro_batch"],
            RECOMPUTE_ORDER.index(r["recompute"]))


def plan(cfg, gpus: int, gpu_mem: int, global_batch: int, seq: int, cm: CostModel,
         supported_only: bool = False) -> dict:
    """Enumerate and rank layouts of GPT ``cfg`` on ``gpus`` GPUs with ``gpu_mem`` bytes each.

    Layouts: dp*tp*pp = gpus with tp | n_head, pp <= n_layer, dp | global_batch (and tp | seq with
    SP); micro-batch a power of two dividing global_batch/dp; for pp > 1 schedule 1f1b | gpipe |
    interleaved (v = 2, only when m % pp == 0 and 2pp <= n_layer), "none" for pp = 1; ZeRO 0-3;
    recompute none | selective | full. Each is priced by :func:`evaluate`; those over ``gpu_mem``
    are dropped, and with ``supported_only`` what zerotron cannot run today (pp > 1 with tp > 1 or
    ZeRO > 0). Returns ``{"layouts": feasible ones, best (shortest step) first, ties broken by
    memory then (pp, tp, zero, schedule, -micro_batch, recompute), "dropped": {reason: count}}``:
    "divisibility" and "layers" count (dp, tp, pp) meshes, the others layouts. Raises ValueError
    for non-positive sizes, gpus % gpus_per_node != 0 or seq > block_size."""
    for name, val in (("gpus", gpus), ("gpus_per_node", cm.gpus_per_node),
                      ("global_batch", global_batch), ("seq", seq)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if gpus % cm.gpus_per_node:
        raise ValueError(f"gpus ({gpus}) must be a multiple of gpus_per_node ({cm.gpus_per_node})")
    if seq > cfg.block_size:
        raise ValueError(f"seq ({seq}) exceeds the model's block_size ({cfg.block_size})")
    dropped = dict.fromkeys(("divisibility", "layers", "schedule", "unsupported", "memory"), 0)
    out = []
    meshes = [(gpus // (t * p), t, p) for t in range(1, gpus + 1) if gpus % t == 0
              for p in range(1, gpus // t + 1) if gpus // t % p == 0]
    for dp, tp, pp in meshes:
        if cfg.n_head % tp or global_batch % dp or (cm.sp and seq % tp):
            dropped["divisibility"] += 1
            continue
        if pp > cfg.n_layer:
            dropped["layers"] += 1
            continue
        per_dp = global_batch // dp
        for b in [1 << i for i in range(per_dp.bit_length()) if per_dp % (1 << i) == 0]:
            m = per_dp // b
            for kind in ["none"] if pp == 1 else ["1f1b", "gpipe", "interleaved"]:
                if kind == "interleaved" and (m % pp or 2 * pp > cfg.n_layer):
                    dropped["schedule"] += 12  # 4 ZeRO stages x 3 recompute modes
                    continue
                for z, rec in product(range(4), RECOMPUTE_ORDER):
                    if supported_only and pp > 1 and (tp > 1 or z > 0):
                        dropped["unsupported"] += 1
                        continue
                    lay = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": z, "schedule": kind,
                           "micro_batch": b, "recompute": rec}
                    res = evaluate(cfg, lay, seq, global_batch, cm)
                    if res["memory_bytes_per_gpu"] > gpu_mem:
                        dropped["memory"] += 1
                    else:
                        out.append(res)
    return {"layouts": sorted(out, key=_rank_key), "dropped": dropped}


def _model_from_args(args):
    """(GPTConfig, the config's global batch or None) from --model or --config."""
    from zerotron.models.gpt import GPTConfig, preset_config

    if args.model:
        return preset_config(args.model), None
    from zerotron.config import ConfigError, load_config, model_shape

    try:
        c = load_config(args.config)
        shape = model_shape(c.model)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    vocab = c.model.vocab_size or shape.get("vocab_size") or c.data.vocab_size
    return GPTConfig(vocab_size=vocab, block_size=shape["block_size"], n_layer=shape["n_layer"],
                     n_head=shape["n_head"], n_embd=shape["n_embd"], dropout=c.model.dropout,
                     bias=c.model.bias).validate(), c.train.global_batch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerotron plan", description="Rank parallel layouts of a GPT "
                                "by predicted memory and step time (zerotron.analysis.planner).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model preset (zerotron.models.gpt.PRESETS)")
    src.add_argument("--config", help="TOML config ([model] shape, train.global_batch)")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs G")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node K (8)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU type (h100)")
    p.add_argument("--gpu-mem", help="usable memory per GPU, e.g. 80GB (default: the GPU's)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, help="sequence length (default: block_size)")
    p.add_argument("--calibrate", help="'bench comm --json' file: measured intra-node busbw")
    p.add_argument("--top", type=int, default=10, help="layouts to show (10)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--sp", action="store_true", help="sequence parallelism when tp > 1")
    p.add_argument("--attention", default="flash", choices=("flash", "math"),
                   help="flash (SDPA on GPUs): no s^2 activations; math: Korthikanti's count")
    p.add_argument("--compute-eff", type=float, default=0.5, help="achieved/peak FLOP/s (0.5)")
    p.add_argument("--comm-eff", type=float, default=0.8, help="achieved/datasheet bw (0.8)")
    p.add_argument("--overhead", default="2GB", help="fixed framework memory per GPU (2GB)")
    p.add_argument("--supported-only", action="store_true",
                   help="only layouts zerotron runs today (pp > 1 needs tp = 1 and ZeRO 0)")
    return p


def plan_main(argv: list) -> int:
    """``zerotron plan (--model PRESET | --config F) --gpus G [--gpus-per-node K] [--gpu-mem 80GB]
    --global-batch B [--seq S] [--gpu h100|h200|a100] [--calibrate bench_comm.json] [--top 10]
    [--json] [--sp] [--attention flash|math] [--compute-eff E] [--comm-eff E] [--overhead 2GB]
    [--supported-only]``: the best layouts of :func:`plan` as a table, or with ``--json``
    ``{"layouts": [top ones], "dropped": {reason: count}, "feasible": n, "assumptions": {...}}``.
    Defaults: --seq = block_size, --gpu-mem = the GPU's memory, --global-batch from --config.
    Returns 0, 1 if no layout fits, 2 on a usage or value error (message on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage error on stderr
        return 0 if exc.code in (0, None) else 2
    try:
        cfg, default_batch = _model_from_args(args)
        batch = args.global_batch or default_batch
        if not batch:
            raise ValueError("--global-batch is required with --model")
        if args.top < 1 or not 0 < args.compute_eff <= 1:
            raise ValueError("--top must be >= 1 and --compute-eff in (0, 1]")
        hw = hardware(args.gpu, args.comm_eff)
        if args.calibrate:
            try:
                with open(args.calibrate) as f:
                    hw = calibrate(hw, json.load(f))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read calibration file {args.calibrate!r}: {e}") from None
        mem = parse_memory(args.gpu_mem) if args.gpu_mem else hw.memory
        cm = CostModel(hw, args.gpus_per_node, args.compute_eff, parse_memory(args.overhead),
                       args.attention, args.sp)
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
                   "calibrated_from": args.calibrate, "seq": seq, "global_batch": batch,
                   "gpus": args.gpus, "precision": "bf16-mixed + Adam (K=12), bf16 activations",
                   "rank_order": "(pp, dp, tp), tp innermost",
                   "overlap": "none: tp, pp and dp communication all on the critical path"}
    if args.json:
        print(json.dumps({"layouts": top, "dropped": res["dropped"],
                          "feasible": len(res["layouts"]), "assumptions": assumptions}))
        return 0 if top else 1
    print(f"zerotron plan: {args.gpus} x {hw.name} ({args.gpus_per_node}/node, {mem / GB:.4g} GB), "
          f"global batch {batch} x seq {seq}: {len(res['layouts'])} layouts fit")
    cols = ("dp", "tp", "pp", "zero", "schedule", "micro-b", "recompute", "mem GB", "step s",
            "tokens/s", "MFU")
    print(" ".join(f"{c:>11}" for c in cols))
    for r in top:
        print(" ".join(f"{v:>11}" for v in (
            r["dp"], r["tp"], r["pp"], r["zero_stage"], r["schedule"], r["micro_batch"],
            r["recompute"], f"{r['memory_bytes_per_gpu'] / GB:.3f}",
            f"{r['predicted_step_time_s']:.4g}", f"{r['predicted_tokens_per_s']:.4g}",
            f"{r['predicted_mfu']:.3f}")))
    print("dropped: " + ", ".join(f"{k} {v}" for k, v in res["dropped"].items()))
    if not top:
        print("zerotron plan: no layout fits: add GPUs or memory, or lower the global batch or "
              "sequence length", file=sys.stderr)
    return 0 if top else 1
