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

import re

from zerotron.analysis.activations import stage_layer_counts
from zerotron.analysis.flops import num_params as config_num_params
from zerotron.analysis.flops import shape_of
from zerotron.analysis.hardware import GB  # the tables use decimal gigabytes, as the ZeRO paper does
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


def parse_memory(text: str) -> int:
    """Bytes in "80GB", "80 GiB", "512MB", "1.5TB" (decimal B/KB/MB/GB/TB, binary KiB/MiB/GiB/TiB).
    Raises ValueError for anything else or a size under one byte."""
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", str(text))
    n = int(float(m.group(1)) * units[m.group(2).lower()]) if m and m.group(2).lower() in units else 0
    if n < 1:  # (was: "0.5B" gave 0 bytes, and "1KB" was called no memory size)
        raise ValueError(f"bad memory size {text!r}: use e.g. 80GB or 80GiB")
    return n


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
