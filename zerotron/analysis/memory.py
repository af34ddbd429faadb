"""ZeRO model-state memory estimator (params, grads, optimizer state) per data-parallel rank.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3 and Figure 1. With Psi parameters, N data-parallel ranks and K bytes of optimizer
state per parameter, the bytes per rank are

    stage 0 (plain DP):        P*Psi   + G*Psi   + K*Psi
    stage 1 (optimizer state): P*Psi   + G*Psi   + K*Psi/N
    stage 2 (+ gradients):     P*Psi   + G*Psi/N + K*Psi/N
    stage 3 (+ parameters):    P*Psi/N + G*Psi/N + K*Psi/N

where P, G are bytes per parameter / gradient element. HSDP (``dp_replicate`` = R replicas): N is
the shard-group size dp / R. Activations, temporary buffers and
fragmentation are not model states and are not counted here.

Sharding uses exact integer arithmetic: a sharded state gives each rank ceil(Psi/N) elements (the
flat buffer is padded to a multiple of N, as ZeRO implementations do), times its bytes per element.
So for Psi divisible by N the numbers equal the paper's formulas exactly; otherwise they are the
per-rank size of the padded shard, never an underestimate.
"""

from __future__ import annotations

import argparse
import json
import math
import re
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
from zerotron.analysis.flops import num_params as config_num_params
from zerotron.analysis.flops import shape_of
from zerotron.models.layout import tp_refusal

STAGES = (0, 1, 2, 3)

# bytes per element: (param, grad, {optimizer: optimizer-state bytes per parameter})
# fp32: weights and grads fp32; Adam keeps m and v (4+4), SGD-momentum one buffer (4).
# bf16-mixed (ZeRO paper, "mixed precision", K=12 for Adam): 16-bit weights and grads; the optimizer
# holds an fp32 master copy (4) + m (4) + v (4) for Adam, master (4) + momentum (4) for SGD.
_BYTES = {
    "fp32": (4, 4, {"adam": 8, "sgd": 4}),
    "bf16-mixed": (2, 2, {"adam": 12, "sgd": 8}),
    "fp64": (8, 8, {"adam": 16, "sgd": 8}),  # train.dtype = fp64 (numerics debugging, parity tests)
}
DTYPES = tuple(_BYTES)
OPTIMIZERS = ("adam", "sgd")
OFFLOADS = ("none", "optimizer", "optimizer-disk", "params")  # train.offload values the estimator prices
GB = 10**9  # the tables use decimal gigabytes, as the ZeRO paper does


def _validate(num_params: int, dp: int, stage: int, dtype: str, optimizer: str) -> None:
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a non-negative int, got {num_params!r}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an int >= 1, got {dp!r}")
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}")
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")


def model_state_bytes(num_params: int, dp: int, stage: int, dtype: str = "fp32",
                      optimizer: str = "adam", dp_replicate: int = 1, trainable: int | None = None,
                      offload: str = "none") -> dict:
    """Model-state bytes held by one data-parallel rank under ZeRO stage ``stage``.

    Returns ``{"params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"}``, ints in bytes
    per rank. Formula: ZeRO paper (Rajbhandari et al. 2020) section 3 / Figure 1, see the module
    docstring; stage 1 shards the optimizer state over ``dp`` ranks, stage 2 also the gradients,
    stage 3 also the parameters. A sharded state costs ceil(num_params/dp) elements per rank.

    ``dtype``: "fp32" (4-byte params and grads; Adam 8 bytes/param for m and v, SGD-momentum 4) or
    "bf16-mixed" (2-byte params and grads; optimizer K = 12 bytes/param for Adam = fp32 master +
    m + v, K = 8 for SGD-momentum = master + momentum) or "fp64" (8-byte everything, Adam 16). ``optimizer``: "adam" or "sgd".

    ``dp_replicate`` (HSDP, ``parallel.dp_replicate``): the dp ranks form ``dp_replicate``
    replicas of S = dp / dp_replicate shards, so the state is sharded over S, not dp (each replica
    holds a full copy): ceil(num_params/S) elements per rank.

    ``trainable``: the parameters that train (LoRA: the adapters; None = all): only they have
    gradients and optimizer state; all ``num_params`` are held as parameters.

    ``offload = "optimizer"`` (``train.offload``, ZeRO-Offload, Ren et al. 2021; stages 1-3): the
    optimizer's share moves to host memory -- ``optimizer_bytes`` is 0 and ``host_bytes`` holds the
    master shard, the optimizer state and the host copy of the gradient shard (master dtype: fp32,
    fp64 in fp64), per shard element 4 + 8 + 4 = 16 bytes for Adam in fp32 or bf16-mixed; the
    result also has ``disk_bytes`` (0). The device keeps the parameters and gradients.
    ``offload = "optimizer-disk"`` (the disk tier, ZeRO-Infinity, Rajbhandari et al. 2021): the
    master shard and the optimizer state move to ``disk_bytes`` (4 + 8 = 12 bytes per shard element
    for Adam; fp64: 24), ``host_bytes`` keeps only the host copy of the gradient shard (4; on a
    CPU-only machine the run reads the device gradient directly and holds none).
    ``offload = "params"`` (stage 3 only; ZeRO-Infinity's parameter offload): ``"optimizer"`` plus the
    parameter shard at rest on the host -- ``params_bytes`` is 0 (the unit gathered for compute is
    transient, not model state) and ``host_bytes`` adds the compute-dtype shard (bf16-mixed: 2 bytes
    per shard element; fp32/fp64: the master is the compute shard, so only frozen parameters add).

    Raises ValueError, naming the valid values, for a bad num_params, dp, stage, dtype, optimizer or
    offload (offload needs stage >= 1, params stage 3), a dp_replicate that does not divide dp, or trainable outside
    [0, num_params].
    """
    _validate(num_params, dp, stage, dtype, optimizer)
    if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1 or dp % dp_replicate:
        raise ValueError(f"dp_replicate must be an int >= 1 dividing dp ({dp}), got {dp_replicate!r}")
    if trainable is not None and (isinstance(trainable, bool) or not isinstance(trainable, int)
                                  or not 0 <= trainable <= num_params):
        raise ValueError(f"trainable must be an int in [0, num_params = {num_params}], got {trainable!r}")
    p_bytes, g_bytes, opt_table = _BYTES[dtype]
    k_bytes = opt_table[optimizer]
    S = dp // dp_replicate
    shard = -(-num_params // S)  # ceil(Psi / S): elements of a padded flat shard
    n_train = num_params if trainable is None else trainable
    t_shard = -(-n_train // S)
    params = p_bytes * (shard if stage >= 3 else num_params)
    grads = g_bytes * (t_shard if stage >= 2 else n_train)
    optim = k_bytes * (t_shard if stage >= 1 else n_train)
    if offload not in OFFLOADS or (offload != "none" and stage < 1) or (offload == "params" and stage != 3):
        raise ValueError(f"offload must be one of {list(OFFLOADS)} (not none only with stage >= 1, params only with "
                         f"stage 3), got {offload!r} at stage {stage}")
    if offload != "none":
        master = 8 if dtype == "fp64" else 4  # host master (and host gradient) dtype
        state = t_shard * (k_bytes if dtype == "bf16-mixed" else master + k_bytes)  # master + optimizer state
        disk = state if offload == "optimizer-disk" else 0
        host_params = 0
        if offload == "params":  # the compute shard moves to the host (the master where the dtypes agree)
            host_params = p_bytes * (shard if dtype == "bf16-mixed" else shard - t_shard)
            params = 0
        return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": 0, "total_bytes": params + grads,
                "host_bytes": t_shard * master + state - disk + host_params, "disk_bytes": disk}
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optim,
            "total_bytes": params + grads + optim}


def zero_table(num_params: int, dp: int, dtype: str = "fp32", optimizer: str = "adam",
               dp_replicate: int = 1, offload: str = "none") -> list:
    """Rows for ZeRO stages 0..3 (1..3 with an ``offload``): ``[{"stage", "params_bytes",
    "grads_bytes", "optimizer_bytes", "total_bytes"[, "host_bytes", "disk_bytes"]}, ...]`` (bytes
    per rank, see :func:`model_state_bytes`; ``dp_replicate``: HSDP replicas). Raises ValueError
    for bad arguments (same rules as :func:`model_state_bytes`)."""
    return [{"stage": s, **model_state_bytes(num_params, dp, s, dtype, optimizer, dp_replicate, offload=offload)}
            for s in STAGES if offload == "none" or s >= (3 if offload == "params" else 1)]


def format_table(rows: list) -> str:
    """Render :func:`zero_table` rows as a fixed-width text table in decimal GB (1e9 bytes) per
    rank, 4 significant digits. Raises KeyError if a row lacks one of the byte keys."""
    cols = [("stage", "ZeRO stage"), ("params_bytes", "params GB"), ("grads_bytes", "grads GB"),
            ("optimizer_bytes", "optimizer GB"), ("total_bytes", "total GB")]
    if rows and "host_bytes" in rows[0]:  # offload: the device total, then host memory
        cols[-1] = ("total_bytes", "device GB")
        cols.append(("host_bytes", "host GB"))
        if any(r.get("disk_bytes") for r in rows):
            cols.append(("disk_bytes", "disk GB"))
    lines = ["  ".join(f"{title:>12}" for _, title in cols)]
    for row in rows:
        cells = [f"{row['stage']:>12}"]
        cells += [f"{row[key] / GB:>12.4g}" for key, _ in cols[1:]]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def offload_dir_refusal(cfg, plan, local_ranks: int | None = None) -> str | None:
    """The check of ``train.offload_dir`` for ``train.offload = optimizer-disk`` before any process
    starts: None when it is usable, else the one line that refuses it -- the folder is missing (or
    not a folder), read-only (a read-only mount, no write permission, or no write bit at all), or
    has less free space than the files need. Needed bytes: :func:`model_state_bytes`' ``disk_bytes``
    for the largest model-parallel rank's parameters (:func:`stage_num_params`, sharded over dp_shard x cp)
    times ``local_ranks`` (the processes on this machine; default ``LOCAL_WORLD_SIZE`` or the
    world size). Writes nothing. Raises nothing for an unknown model (then only the folder checks)."""
    import os
    import shutil

    if plan.offload != "optimizer-disk":
        return None
    d = plan.offload_dir
    if not os.path.isdir(d):
        return (f"train.offload_dir {d!r} does not exist or is not a folder: create it (mkdir -p {d}) or point "
                "train.offload_dir at an existing folder")
    if (os.statvfs(d).f_flag & os.ST_RDONLY) or not os.access(d, os.W_OK | os.X_OK) or not os.stat(d).st_mode & 0o222:
        return (f"train.offload_dir {d!r} is read-only: make it writable (chmod u+w {d}) or choose another folder")
    try:
        dtype = {"fp64": "fp64", "bf16": "bf16-mixed"}.get(plan.dtype, "fp32")
        from zerotron.config import model_shape
        from zerotron.models.registry import config_from_section

        shape = model_shape(cfg.model)
        mcfg = config_from_section(cfg.model, cfg.model.vocab_size or shape.get("vocab_size") or cfg.data.vocab_size)
        share = max(stage_num_params(mcfg, plan.tp, plan.pp))
        per_rank = model_state_bytes(share, plan.dp_shard * plan.cp, max(plan.zero_stage, 1), dtype,
                                     offload="optimizer-disk")["disk_bytes"]
    except (ValueError, KeyError, TypeError):
        return None
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
    need, free = per_rank * ranks, shutil.disk_usage(d).free
    if free < need:
        return (f"train.offload_dir {d!r} has {free:,} bytes free, the optimizer state files need about {need:,} "
                f"bytes ({per_rank:,} per rank x {ranks} ranks): free space or choose a larger disk")
    return None


def _count(text: str) -> int:
    """argparse type: a positive integer count, also written like 7e9 or 7_000_000_000."""
    try:
        value = float(text.replace("_", "")) if any(c in text for c in ".eE") else int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 1 or value != int(value):  # 1e400 is inf: int() would raise
        raise argparse.ArgumentTypeError(f"must be a positive integer (a parameter count like 7e9), got {text!r}")
    return int(value)


def parse_memory(text: str) -> int:
    """Bytes in "80GB", "80 GiB", "512MB", "1.5TB" (decimal GB/MB/TB, binary GiB/MiB/TiB).
    Raises ValueError for anything else or a non-positive size."""
    units = {"b": 1, "mb": 10**6, "gb": 10**9, "tb": 10**12, "mib": 2**20, "gib": 2**30,
             "tib": 2**40}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", str(text))
    if not m or m.group(2).lower() not in units or float(m.group(1)) <= 0:
        raise ValueError(f"bad memory size {text!r}: use e.g. 80GB or 80GiB")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def preset_config(name: str):
    """The config of model preset ``name`` of any family (``zerotron.models.registry``). Raises
    ValueError for an unknown preset, listing them all."""
    from zerotron.models.registry import preset_config as registry_preset  # lazy: torch stays out

    return registry_preset(name)


def preset_num_params(name: str) -> int:
    """Parameter count of model preset ``name`` (GPT-2 or Llama) computed from its config with
    :func:`zerotron.analysis.flops.num_params` (nothing is allocated). Raises ValueError for an
    unknown preset."""
    return config_num_params(preset_config(name))


def stage_num_params(cfg, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                     layer_counts: list[int] | None = None) -> list[int]:
    """Parameters (a count) held by one tensor-parallel rank of each pipeline rank 0..pp-1 of the
    model of ``cfg`` (a ``GPTConfig``, ``LlamaConfig`` or a :class:`zerotron.analysis.flops.Shape`),
    with ``virtual_stages`` model stages per rank (interleaved).

    Megatron-style split (Shoeybi et al. 2019, :meth:`Shape.block_params`): per block the
    column-parallel q/k/v (GQA: k and v C x H_kv*D) and first MLP matrices (GELU's fc1; SwiGLU's gate
    and up) with their biases, and the row-parallel o/last MLP weights are divided by tp, row-parallel
    biases and the norms replicated; the token embedding is vocab-parallel (ceil(V/tp) rows), a
    learned position table replicated on stage 0; the last stage holds the final norm, an untied
    output head (ceil(V/tp) rows) or, for a tied head when it is not on the first stage's rank, a
    tied copy of the token embedding (as ``parallel.pipeline.executor`` does). Layers per stage as
    :func:`zerotron.analysis.activations.stage_layer_counts`, or ``layer_counts`` (one count per
    model stage, as ``parallel.pp_split``). With tp = pp = 1 the sum equals
    :func:`zerotron.analysis.flops.num_params`. Raises ValueError with the reason of
    :func:`zerotron.models.layout.tp_refusal` (tp must divide n_head, n_kv_head and the SwiGLU
    width), if pp*virtual_stages > n_layer, or ``layer_counts`` does not have
    pp*virtual_stages positive counts summing to n_layer."""
    s = cfg if hasattr(cfg, "block_params") else shape_of(cfg)
    v = virtual_stages
    reason = tp_refusal(tp, s.tp_sizes())
    if reason:
        raise ValueError(reason)
    counts = stage_layer_counts(s.n_layer, pp * v)
    if layer_counts is not None:
        if len(layer_counts) != pp * v or sum(layer_counts) != s.n_layer or min(layer_counts) < 1:
            raise ValueError(f"layer_counts {list(layer_counts)} must be {pp * v} counts >= 1 summing to "
                             f"n_layer ({s.n_layer})")
        counts = list(layer_counts)
    block = s.block_params(tp)
    tied_copy = -(-s.vocab_size // tp) * s.n_embd if s.tied and pp > 1 else 0
    out = []
    for r in range(pp):
        n = sum(counts[c * pp + r] for c in range(v)) * block
        if r == 0:
            n += s.embedding_params(tp)
        if r == pp - 1:
            n += s.norm_params + s.output_params(tp) + tied_copy
        out.append(n)
    return out


def moe_state_bytes(params: int, experts: int, dp: int, ep: int, stage: int, dtype: str = "fp32",
                    optimizer: str = "adam", cp: int = 1, dp_replicate: int = 1, offload: str = "none") -> dict:
    """Model-state bytes of one rank holding ``params`` parameters (its tp / pipeline share, all E
    experts of its MoE layers counted) of which ``experts`` are expert parameters, under expert
    parallelism ``ep`` carved out of the batch group dp x cp (``zerotron.parallel.expert``): the
    dense ``params - experts`` under ZeRO ``stage`` over dp x cp (HSDP: over dp / R x cp) and the
    rank's ``experts / ep`` under it over the (dp x cp) / ep ranks that hold the same experts (the
    expert-replica group; native ZeRO shards the expert flat buffers over it; HSDP: / R). At ep 1
    the experts are sharded with the rest, over dp x cp. Each part by :func:`model_state_bytes`
    (ZeRO paper, section 3), so a padded shard is counted per part. Returns
    ``{"dense_state_bytes", "expert_state_bytes", "total_bytes"}`` (bytes per rank). Raises
    ValueError for an ep that does not divide experts or the shard degree dp / R x cp, or the
    arguments :func:`model_state_bytes` refuses."""
    batch = dp * cp
    if ep < 1 or experts % ep or (dp // max(dp_replicate, 1) * cp) % ep or not 0 <= experts <= params:
        raise ValueError(f"ep ({ep}) must divide the expert parameters ({experts}) and the shard degree dp / "
                         f"dp_replicate x cp ({dp} / {dp_replicate} x {cp}), experts within params ({params})")
    dense = model_state_bytes(params - experts, batch, stage, dtype, optimizer, dp_replicate, offload=offload)
    local = model_state_bytes(experts // ep, batch // ep, stage, dtype, optimizer, dp_replicate, offload=offload)
    return {"dense_state_bytes": dense["total_bytes"], "expert_state_bytes": local["total_bytes"],
            "total_bytes": dense["total_bytes"] + local["total_bytes"]}


def moe_all_to_all_bytes(cfg, layers: int, tokens: int, microbatches: int, elem_bytes: int,
                         recompute: str = "none") -> int:
    """Bytes one rank of an ep group sends per optimizer step by the token all-to-all (the mean over
    the group; ``comm.all_to_all_v`` counts the bytes a rank sends, its own rows included) for
    ``layers`` MoE layers, ``microbatches`` micro-batches of ``tokens`` routed tokens each (b x S /
    cp per rank; / tp more under sequence parallelism, where each tp rank routes its shard) and
    ``elem_bytes`` per activation element: per layer and micro-batch the dispatch and the combine in
    the forward and again in the backward, 4 x tokens x k x C elements, plus the per-expert counts
    (E int64) of each forward; ``recompute`` "full" re-runs the forward in the backward (one more
    dispatch + combine + counts: 6 exchanges); "selective" recomputes attention only.
    A single rank sends its N*k rows in the dispatch but, in the combine, the rows its experts
    received: that half depends on the routing; the sum over the group is exact."""
    s = shape_of(cfg)
    fwd = 2 if recompute == "full" else 1
    return layers * microbatches * ((2 + 2 * fwd) * tokens * s.top_k * s.n_embd * elem_bytes + fwd * 8 * s.n_experts)


def moe_estimate(cfg, dp: int, ep: int = 1, stage: int = 0, dtype: str = "fp32", optimizer: str = "adam",
                 seq: int | None = None, micro_batch: int = 1, microbatches: int = 1, cp: int = 1,
                 dp_replicate: int = 1, tp: int = 1, sp: bool = False, pp: int = 1, schedule: str = "1f1b",
                 virtual_stages: int = 1, recompute: str = "none") -> dict:
    """What a mixture-of-experts model costs per rank under expert parallelism ``ep`` carved out of
    the batch group ``dp`` x ``cp`` (``zerotron.parallel.expert``), from the shape of ``cfg`` (any
    config :func:`shape_of` reads, with ``n_experts`` > 0), at tensor / pipeline parallelism ``tp``,
    ``pp`` (``schedule``, ``virtual_stages`` chunks per rank). Pure arithmetic. Returns a dict:

      * ``total_params``, ``active_params`` (one token: router + k of E experts per layer, the rest),
        ``expert_params`` (all layers, all E experts), ``dense_params`` (total - expert);
      * ``flops_per_token``: training FLOPs from the active parameters, 6 N_active + 12 L C S
        (PaLM appendix B with N the matmul parameters a token meets; needs ``seq``, else 6 N_active);
      * of the largest pipeline rank (all of the model at pp = 1): ``expert_params_per_rank`` (its
        layers' experts / ep),
        ``expert_state_bytes`` (its E/ep experts' params + grads + optimizer under ZeRO ``stage``
        over the (dp x cp) / ep ranks holding them) and ``dense_state_bytes`` (the rest under
        ``stage`` over dp x cp): :func:`moe_state_bytes`;
      * ``all_to_all_bytes`` per rank and optimizer step of the largest pipeline rank, the mean over
        the ep group (ep > 1 and ``seq`` given; else 0): :func:`moe_all_to_all_bytes` for the
        ``microbatches`` micro-batches of ``micro_batch`` x ``seq`` / cp tokens (/ tp with ``sp``);
      * ``pipeline_ranks``: per pipeline rank ``{"params", "expert_params"`` (all E per layer),
        ``"layers", "all_to_all_bytes", "states": [{"stage", "dense_state_bytes",
        "expert_state_bytes", "total_bytes"}`` for ZeRO stages 0-3]}`` -- what ``zerotron plan``
        prices for an ep layout (``analysis.planner.evaluate``).
    Raises ValueError for a dense model, ep < 1 or an ep that does not divide E or dp x cp (the
    shard degree dp / dp_replicate x cp under HSDP)."""
    s = shape_of(cfg)
    E = s.n_experts
    if not E:
        raise ValueError("moe_estimate needs a mixture-of-experts model (n_experts > 0)")
    if ep < 1 or E % ep or (dp // max(dp_replicate, 1) * cp) % ep:
        raise ValueError(f"--ep ({ep}) must be >= 1 and divide n_experts ({E}) and the batch degree dp x cp "
                         f"({dp} x {cp}; the shard degree dp / dp_replicate x cp under HSDP)")
    expert = s.n_layer * E * 3 * s.n_embd * s.ffn
    total, active = s.num_params(), s.active_params()
    flops = 6 * s.flop_params() + (12 * s.n_layer * s.n_embd * seq if seq else 0)
    elem = {"fp32": 4, "fp64": 8}.get(dtype, 2)  # the activations' dtype (bf16-mixed: 2)
    v = virtual_stages if schedule in ("interleaved", "zb-v") else 1
    counts = looped_counts(stage_layer_counts(s.n_layer, pp * v), pp, schedule)  # index chunk * pp + rank
    ranks = []
    tokens = micro_batch * (seq or 0) // cp // (tp if sp and tp > 1 else 1)
    for r, params in enumerate(stage_num_params(s, tp, pp, v, counts)):
        layers = sum(counts[c * pp + r] for c in range(v))
        experts = layers * E * 3 * s.n_embd * s.ffn
        states = [{"stage": z, **moe_state_bytes(params, experts, dp, ep, z, dtype, optimizer, cp, dp_replicate)}
                  for z in STAGES]
        a2a = moe_all_to_all_bytes(s, layers, tokens, microbatches, elem, recompute) if ep > 1 and seq else 0
        ranks.append({"params": params, "expert_params": experts, "layers": layers, "all_to_all_bytes": a2a,
                      "states": states})
    top = max(ranks, key=lambda x: x["states"][stage]["total_bytes"])
    return {"total_params": total, "active_params": active, "expert_params": expert, "dense_params": total - expert,
            "flops_per_token": flops, "expert_params_per_rank": top["expert_params"] // ep,
            "expert_state_bytes": top["states"][stage]["expert_state_bytes"],
            "dense_state_bytes": top["states"][stage]["dense_state_bytes"],
            "all_to_all_bytes": top["all_to_all_bytes"], "pipeline_ranks": ranks}


def _chunks(args) -> int:
    """Model stages per pipeline rank of the --schedule: --virtual-stages for interleaved and zb-v."""
    return args.virtual_stages if args.schedule in ("interleaved", "zb-v") else 1


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
