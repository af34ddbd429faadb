"""The mixture-of-experts family of the parity matrix: its model, witnesses, layout space (the
dense factors times expert parallelism) and the plan's and the documented refusals."""
from __future__ import annotations

import dataclasses
import itertools

from zerotron.config import ConfigError
from zerotron.plan import CHUNKED_SCHEDULES, build_plan

from .layout import FACTORS, GLOBAL_BATCH, TORCH_KINDS, Layout, config_for
from .refusals import expected_refusal

# ---- the mixture-of-experts family (issue 29) ------------------------------------------------
# Mixtral-style blocks on the matrix model, 4 of them (half the cost; pp 4 with two stages per rank
# is then refused): 4 experts, top-2, both auxiliary losses on (weights 0.1
# and 0.01; their gradients enter the parameters, so a layout that took them over other tokens,
# weighed them differently or synchronised expert gradients over the wrong group fails). The
# load-balancing loss is per micro-batch, so every MoE layout (and the one-process reference) runs
# at train.micro_batch = MOE_MICRO_BATCH: a layout's ``acc`` is then GLOBAL_BATCH / (dp x 2).
MOE_MICRO_BATCH = 2
MOE_MODEL = {"model.arch": "mixtral", "model.n_layer": 4, "model.n_kv_head": 2, "model.intermediate_size": 24, "model.n_experts": 4,
             "model.experts_top_k": 2, "model.moe_aux_loss_coef": 0.1, "model.moe_z_loss_coef": 0.01,
             "model.rope_theta": 10000.0, "train.micro_batch": MOE_MICRO_BATCH}
EP = (1, 2, 4)  # parallel.ep: experts split over ep ranks carved out of dp x cp (ep must divide dp x cp)
# in the default suite: recomputation under ZeRO-3 (router statistics not counted twice), a 1F1B
# pipeline, FSDP2 stage 3 (its gradient average over dp once missed the auxiliary losses' share),
# expert parallelism under ZeRO-1 at ep = dp = 2, ZeRO-2 at dp 4 = 2 expert replicas x ep 2 (expert
# flat buffers sharded over the replica group), and dp 2 x tp 2 with ep 2 (one ep group per tp
# coordinate, experts tp-replicated) under DDP and ZeRO-3; ep 2 under FSDP2 (experts fully_shard-ed
# over dp/ep: their gradient average is over dp/ep ranks, not dp) and under torch DDP (experts in its
# ignore list)
MOE_MUST = ("zero3-dp2-acc4-acfull", "ddp-dp1-pp2-1f1b-even-acc8", "fsdp2_3-dp2-acc4", "zero1-dp2-acc4-ep2",
            "zero2-dp4-acc2-ep2", "ddp-dp2-tp2-acc4-ep2", "zero3-dp2-tp2-acc4-ep2",
            # expert parallelism under a pipeline (each stage's all-to-all in its F and B; ZB-H1's W of the
            # expert weights local, ZeRO-3 gathering the stage's expert shards for it), and sequence
            # parallelism (router statistics summed over the tp shards of each micro-batch) with ep 2, and
            # context parallelism (the same sums over the cp chunks; ring attention)
            "ddp-dp2-pp2-1f1b-acc4-ep2", "zero3-dp2-pp2-zb-h1-acc4-ep2", "zero1-dp2-tp2sp-acc4-ep2",
            "ddp-dp1-cp2-ring-acc8", "fsdp2_3-dp2-acc4-ep2", "torch_ddp-dp2-acc4-ep2",
            # expert parallelism under context parallelism: the ep group is the cp pair (each chunk's
            # tokens routed to the other rank's experts), ring attention under ZeRO-1, a2a under FSDP2
            "zero1-dp1-cp2-ring-acc8-ep2", "fsdp2_3-dp1-cp2-a2a-acc8-ep2",
            # torch's pipelining: its shape inference (a first forward per stage) must not count in the
            # router statistics (it did: aux_err 0.125 in every torch-pipelining MoE layout)
            "ddp-dp1-pp2-torch-gpipe-acc8")
# witnesses of the full MoE run (``make test-moe``) only, 4 processes each: FSDP2 stage 2 at dp 4 =
# ep 2 x 2 expert replicas (the experts' own reduce-scatter group), native HSDP with ep inside the
# shard group (ZeRO-2 and DDP, dp 4 = 2 replicas x 2 shards), FSDP2 x tp with ep
MOE_MUST_FULL = MOE_MUST + ("fsdp2_2-dp4-acc2-ep2", "zero2-dp4r2-acc2-ep2", "ddp-dp4r2-acc2-ep2",
                            "fsdp2_3-dp2-tp2-acc4-ep2",
                            # ep over dp x cp (4 ranks, one ep group; 2 groups of cp pairs), under a pipeline
                            "ddp-dp2-cp2-ring-acc4-ep4", "zero3-dp2-cp2-a2a-acc4-ep2",
                            "torch_ddp-dp1-cp2-ring-acc8-ep2", "zero1-dp1-cp2-a2a-pp2-1f1b-acc8-ep2")


def moe_layouts(max_world: int = 4) -> list[Layout]:
    """The MoE family's layout space: every layout of :func:`all_layouts` with ``acc`` fixed by
    :data:`MOE_MICRO_BATCH` (duplicates merged) times every ep of :data:`EP` dividing its dp x cp, sorted."""
    # the product without the factors that only matter when another is > 1 (as :func:`all_layouts`
    # canonicalises them), which are expanded where they do: 20x fewer combinations
    inner = {"schedule": "pp", "split": "pp", "cp_impl": "cp", "sp": "tp"}
    outer = [k for k in FACTORS if k not in inner and k != "acc"]
    out = set()
    for values in itertools.product(*(FACTORS[k] for k in outer)):
        base = dict(zip(outer, values))
        if base["dp"] * base["cp"] * base["tp"] > max_world:
            continue
        opts = [[(k, v) for v in (FACTORS[k] if base[on] > 1 else (False if k == "sp" else None,))]
                for k, on in inner.items()]
        for extra in itertools.product(*opts):
            lay = Layout(**base, **dict(extra), acc=max(GLOBAL_BATCH // (base["dp"] * MOE_MICRO_BATCH), 1))
            if lay.world <= max_world:
                out.update(dataclasses.replace(lay, ep=ep) for ep in EP if lay.dp * lay.cp % ep == 0)
    return sorted(out, key=lambda l: (l.world, l.name))


def moe_refusal(layout: Layout) -> str | None:
    """The plan's verdict on ``layout`` for the MoE family (None: it runs)."""
    try:
        build_plan(config_for(layout, MOE_MODEL), layout.world)
    except ConfigError as e:
        return str(e)
    return None


def moe_expected_refusal(layout: Layout) -> str | None:
    """The documented reason an MoE layout cannot run (None: it must run): the dense family's
    (:func:`expected_refusal`), then the router's (each rank must see whole micro-batches or, under
    sequence / context parallelism, sum the router statistics over tp / cp), then expert
    parallelism's (carved out of dp x cp; on the plain runner with native DDP, native ZeRO-1/2/3 (HSDP
    with ep inside the shard group), torch DDP and FSDP2 without HSDP; on the native pipeline
    executor with native DDP and native ZeRO without HSDP; tp-replicated experts under tp, so far)."""
    why = expected_refusal(layout)
    if why:
        return why
    chunked = layout.schedule in CHUNKED_SCHEDULES or layout.schedule == "torch-interleaved"
    if layout.pp * (2 if chunked else 1) > MOE_MODEL["model.n_layer"]:
        return "the MoE model's 4 layers cannot fill pp x 2 model stages"
    if layout.ep > 1 and (layout.schedule == "threads" or layout.schedule in TORCH_KINDS):
        return "expert parallelism runs on the plain runner and the native pipeline executor"
    if layout.ep > 1 and layout.rep > 1 and (layout.dp // layout.rep * layout.cp) % layout.ep:
        return "expert parallelism under HSDP: ep must divide the shard degree dp / dp_replicate x cp"
    if layout.ep > 1 and layout.rep > 1 and layout.sync in ("fsdp2_2", "fsdp2_3"):
        return "expert parallelism under FSDP2's HSDP: the experts would need a 2-D mesh of their own"
    if layout.ep > 1 and layout.pp > 1 and (layout.rep > 1 or layout.sync in ("torch_ddp", "fsdp2_2", "fsdp2_3")):
        return "expert parallelism under a pipeline composes with native DDP and native ZeRO without HSDP so far"
    return None
