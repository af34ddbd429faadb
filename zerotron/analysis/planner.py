"""``zerotron plan``: enumerate the layouts (dp, tp, pp, cp, ep, ZeRO stage, schedule, micro-batch,
recompute, HSDP replicas, offload) of a GPT-2, Llama or mixture-of-experts model on G GPUs, price each
by :func:`zerotron.analysis.layout_cost.evaluate` (the cost model: :mod:`zerotron.analysis.cost_model`)
and rank them by predicted step time (:func:`plan`); refuse, in one line naming the GPU counts that
can be split, a GPU count no mesh of the model and batch fits (:func:`split_refusal`)."""
from __future__ import annotations

import math
from itertools import product

from zerotron.analysis.bubble import NCCL_REFUSED, PIPELINE_KINDS
from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.flops import Shape, shape_of
from zerotron.analysis.layout_cost import evaluate, expert_degrees
from zerotron.models.layout import tp_refusal
from zerotron.plan import CHUNKED_SCHEDULES

SCHEDULE_ORDER = ("none", "1f1b", "interleaved", "gpipe", "zb-h1", "zb-v")
RECOMPUTE_ORDER = ("none", "selective", "full")


def _replicas(dp: int, tp: int, pp: int, cm: CostModel) -> list[int]:
    """HSDP replica counts to price for a (dp, tp, pp) mesh: 1 (flat), and, where the dp x tp
    block spans several nodes, R = dp * tp / gpus_per_node so that each shard group x tp fills one
    node (the layout HSDP is for). Under a pipeline the same rule holds per stage: pp is the
    outermost axis, so each stage's dp x tp block is contiguous (pp x native HSDP runs, one ZeRO
    driver or DDP per pipeline rank)."""
    K = cm.gpus_per_node
    if dp * tp <= K or K % tp or dp % (K // tp):
        return [1]
    r = dp // (K // tp)
    return [1, r] if r > 1 else [1]


def _refused(pp: int, rep: int) -> bool:
    """True for a layout zerotron's config validation refuses among those the planner prices
    (native DDP / ZeRO-0..3): none. Pipeline x ZeRO-1/2/3 and pipeline x native HSDP run (one ZeRO
    driver, ``parallel.data.zero``, per pipeline rank), and ``_replicas`` proposes HSDP there too."""
    return False


def _rank_key(r: dict) -> tuple:
    return (r["predicted_step_time_s"], r["memory_bytes_per_gpu"], r["pp"], r["tp"], r.get("cp", 1), r.get("ep", 1),
            r["zero_stage"], SCHEDULE_ORDER.index(r["schedule"]), -r["micro_batch"],
            RECOMPUTE_ORDER.index(r["recompute"]))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending (O(sqrt n): a count of 10**9 GPUs is still quick)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _mesh_refusal(shape: Shape, dp: int, tp: int, pp: int, cp: int, global_batch: int, seq: int,
                  sp: bool) -> str | None:
    """Why the plan prices no layout of the mesh ``dp x tp x pp x cp`` -- "divisibility" (cp: the
    zigzag split needs seq divisible by 2 cp; tp: :func:`tp_refusal`, with sequence parallelism on
    seq / cp; dp must divide the global batch) or "layers" (pp > n_layer) -- or None."""
    if (seq % (2 * cp) if cp > 1 else 0) or tp_refusal(tp, shape.tp_sizes(), seq // cp if sp else None) \
            or global_batch % dp:
        return "divisibility"
    return "layers" if pp > shape.n_layer else None


def split_refusal(shape: Shape, gpus: int, global_batch: int, seq: int, cm: CostModel) -> str | None:
    """Why no mesh dp x tp x pp x cp = ``gpus`` passes :func:`_mesh_refusal` (then no layout can be
    priced at any memory size, so "add GPUs or memory" is the wrong advice: 100,000 GPUs for a
    global batch of 256 said so), or None when some mesh does. The one line names the rules and the
    GPU counts, multiples of ``cm.gpus_per_node``, nearest to ``gpus`` below and above it that some
    mesh can split (none above when ``gpus`` exceeds the largest: global batch x largest tp x
    n_layer x largest cp)."""
    if any(_mesh_refusal(shape, gpus // (t * p * c), t, p, c, global_batch, seq, cm.sp) is None
           for t in _divisors(gpus) for p in _divisors(gpus // t) for c in _divisors(gpus // (t * p))):
        return None
    tps = [t for t in range(1, shape.n_head + 1) if not tp_refusal(t, shape.tp_sizes())]
    cps = [1] + [c for c in _divisors(seq // 2) if c > 1] if seq >= 2 else [1]
    fits = {d * t * p * c for d in _divisors(global_batch) for t in tps for p in range(1, shape.n_layer + 1)
            for c in cps if _mesh_refusal(shape, d, t, p, c, global_batch, seq, cm.sp) is None}
    k = cm.gpus_per_node
    below = max((g for g in fits if g < gpus and g % k == 0), default=None)
    above = min((g for g in fits if g > gpus and g % k == 0), default=None)
    near = " or ".join(f"--gpus {g}" for g in (below, above) if g is not None)
    most = f"; at most {max(fits):,} GPUs can be used" if above is None else ""
    return (f"no split of {gpus:,} GPUs as dp x tp x pp x cp fits this model and batch: dp must divide the global "
            f"batch ({global_batch}), tp must be one of {tps}, pp at most n_layer ({shape.n_layer}), cp must divide "
            f"seq / 2 ({seq // 2}){most}; pass {near or 'fewer GPUs'}, or change --global-batch")


def plan(cfg, gpus: int, gpu_mem: int, global_batch: int, seq: int, cm: CostModel,
         supported_only: bool = False) -> dict:
    """Enumerate and rank layouts of the model of ``cfg`` (GPT-2/Llama config or :class:`Shape`) on
    ``gpus`` GPUs with ``gpu_mem`` bytes each.

    Layouts: dp*cp*tp*pp = gpus (cp: context parallel with ring attention, seq divisible by 2 cp)
    with tp accepted by :func:`zerotron.models.layout.tp_refusal` (the rule
    the plan applies: tp | n_head, n_kv_head and the SwiGLU width, and tp | seq with SP), pp <= n_layer,
    dp | global_batch; micro-batch a power of two dividing global_batch/dp; for pp > 1 schedule 1f1b | gpipe |
    interleaved (v = 2, only when m % pp == 0 and 2pp <= n_layer) | zb-h1 | zb-v (v = 2, only when
    2pp <= n_layer, and only with ``cm.backend`` = "gloo": the runner refuses it on NCCL), "none"
    for pp = 1; ZeRO 0-3 (with ``cm.host_link``, a layout over ``gpu_mem`` is priced again with
    ``offload`` "optimizer", then at ZeRO-3 "params", and kept if that fits); for a mixture-of-experts
    model every ep dividing n_experts and dp x cp (the shard degree dp/R x cp under HSDP; no HSDP
    with ep under a pipeline: :func:`~zerotron.analysis.layout_cost.expert_degrees`);
    recompute none | selective | full. Each is priced by :func:`~zerotron.analysis.layout_cost.evaluate`; those over ``gpu_mem``
    are dropped, and with ``supported_only`` what zerotron's config validation refuses
    (:func:`_refused`; since pipeline x ZeRO-2/3 runs, nothing the planner proposes). Returns ``{"layouts": feasible ones, best (shortest step) first, ties broken by
    memory then (pp, tp, zero, schedule, -micro_batch, recompute), "dropped": {reason: count}}``:
    "divisibility" and "layers" count (dp, tp, pp) meshes, the others layouts ("backend": zb-v
    on NCCL). Raises ValueError
    for non-positive sizes, gpus % gpus_per_node != 0, seq > block_size, or when no mesh of ``gpus``
    passes the divisibility and layer rules (:func:`split_refusal`: the line names the GPU counts
    that can be split)."""
    for name, val in (("gpus", gpus), ("gpus_per_node", cm.gpus_per_node),
                      ("global_batch", global_batch), ("seq", seq)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if gpus % cm.gpus_per_node:
        raise ValueError(f"gpus ({gpus}) must be a multiple of gpus_per_node ({cm.gpus_per_node})")
    if seq > cfg.block_size:
        raise ValueError(f"seq ({seq}) exceeds the model's block_size ({cfg.block_size})")
    if cm.backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be nccl or gloo, got {cm.backend!r}")
    dropped = dict.fromkeys(("divisibility", "layers", "schedule", "backend", "unsupported", "memory"), 0)
    out = []
    meshes = [(gpus // (t * p * c), t, p, c) for t in _divisors(gpus) for p in _divisors(gpus // t)
              for c in _divisors(gpus // (t * p))]
    cfg = cfg if isinstance(cfg, Shape) else shape_of(cfg)
    refusal = split_refusal(cfg, gpus, global_batch, seq, cm)
    if refusal:
        raise ValueError(refusal)
    for dp, tp, pp, cp in meshes:
        why = _mesh_refusal(cfg, dp, tp, pp, cp, global_batch, seq, cm.sp)
        if why:
            dropped[why] += 1
            continue
        per_dp = global_batch // dp
        for b in [1 << i for i in range(per_dp.bit_length()) if per_dp % (1 << i) == 0]:
            m = per_dp // b
            for kind in ["none"] if pp == 1 else PIPELINE_KINDS:
                if (kind == "interleaved" and m % pp) or (kind in CHUNKED_SCHEDULES and 2 * pp > cfg.n_layer):
                    dropped["schedule"] += 12  # 4 ZeRO stages x 3 recompute modes
                    continue
                if kind in NCCL_REFUSED and cm.backend == "nccl":
                    dropped["backend"] += 12
                    continue
                for z, rec, rep, ep in [(z, rec, rep, ep) for z, rec, rep in product(
                        range(4), RECOMPUTE_ORDER, _replicas(dp, tp, pp, cm) if cp == 1 else [1])
                        for ep in expert_degrees(cfg, dp, pp, cp, rep)]:
                    if supported_only and _refused(pp, rep):
                        dropped["unsupported"] += 1
                        continue
                    lay = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": z, "schedule": kind,
                           "micro_batch": b, "recompute": rec}
                    if rep > 1:
                        lay["dp_replicate"] = rep
                    if ep > 1:
                        lay["ep"] = ep
                    if cp > 1:
                        lay["cp"] = cp
                    res = evaluate(cfg, lay, seq, global_batch, cm, gpu_mem)
                    # with a host link: offload where the layout does not fit otherwise (optimizer, then params)
                    for off in (("optimizer", "params") if z == 3 else ("optimizer",)) if z and cm.host_link else ():
                        if res["memory_bytes_per_gpu"] <= gpu_mem:
                            break
                        res = evaluate(cfg, {**lay, "offload": off}, seq, global_batch, cm, gpu_mem)
                    if res["memory_bytes_per_gpu"] > gpu_mem:
                        dropped["memory"] += 1
                    else:
                        out.append(res)
    return {"layouts": sorted(out, key=_rank_key), "dropped": dropped}
