"""ZeRO model-state memory estimator (params, grads, optimizer state) per data-parallel rank.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3 and Figure 1. With Psi parameters, N data-parallel ranks and K bytes of optimizer
state per parameter, the bytes per rank are

    stage 0 (plain DP):        P*Psi   + G*Psi   + K*Psi
    stage 1 (optimizer state): P*Psi   + G*Psi   + K*Psi/N
    stage 2 (+ gradients):     P*Psi   + G*Psi/N + K*Psi/N
    stage 3 (+ parameters):    P*Psi/N + G*Psi/N + K*Psi/N

where P, G are bytes per parameter / gradient element. Activations, temporary buffers and
fragmentation are not model states and are not counted here.

Sharding uses exact integer arithmetic: a sharded state gives each rank ceil(Psi/N) elements (the
flat buffer is padded to a multiple of N, as ZeRO implementations do), times its bytes per element.
So for Psi divisible by N the numbers equal the paper's formulas exactly; otherwise they are the
per-rank size of the padded shard, never an underestimate.
"""

from __future__ import annotations

import argparse
import json
import sys

from zerotron.analysis.flops import gpt_num_params

STAGES = (0, 1, 2, 3)

# bytes per element: (param, grad, {optimizer: optimizer-state bytes per parameter})
# fp32: weights and grads fp32; Adam keeps m and v (4+4), SGD-momentum one buffer (4).
# bf16-mixed (ZeRO paper, "mixed precision", K=12 for Adam): 16-bit weights and grads; the optimizer
# holds an fp32 master copy (4) + m (4) + v (4) for Adam, master (4) + momentum (4) for SGD.
_BYTES = {
    "fp32": (4, 4, {"adam": 8, "sgd": 4}),
    "bf16-mixed": (2, 2, {"adam": 12, "sgd": 8}),
}
DTYPES = tuple(_BYTES)
OPTIMIZERS = ("adam", "sgd")
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
                      optimizer: str = "adam") -> dict:
    """Model-state bytes held by one data-parallel rank under ZeRO stage ``stage``.

    Returns ``{"params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"}``, ints in bytes
    per rank. Formula: ZeRO paper (Rajbhandari et al. 2020) section 3 / Figure 1, see the module
    docstring; stage 1 shards the optimizer state over ``dp`` ranks, stage 2 also the gradients,
    stage 3 also the parameters. A sharded state costs ceil(num_params/dp) elements per rank.

    ``dtype``: "fp32" (4-byte params and grads; Adam 8 bytes/param for m and v, SGD-momentum 4) or
    "bf16-mixed" (2-byte params and grads; optimizer K = 12 bytes/param for Adam = fp32 master +
    m + v, K = 8 for SGD-momentum = master + momentum). ``optimizer``: "adam" or "sgd".

    Raises ValueError, naming the valid values, for a bad num_params, dp, stage, dtype or optimizer.
    """
    _validate(num_params, dp, stage, dtype, optimizer)
    p_bytes, g_bytes, opt_table = _BYTES[dtype]
    k_bytes = opt_table[optimizer]
    shard = -(-num_params // dp)  # ceil(Psi / N): per-rank elements of a padded flat shard
    params = p_bytes * (shard if stage >= 3 else num_params)
    grads = g_bytes * (shard if stage >= 2 else num_params)
    optim = k_bytes * (shard if stage >= 1 else num_params)
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optim,
            "total_bytes": params + grads + optim}


def zero_table(num_params: int, dp: int, dtype: str = "fp32", optimizer: str = "adam") -> list:
    """Rows for ZeRO stages 0..3: ``[{"stage", "params_bytes", "grads_bytes", "optimizer_bytes",
    "total_bytes"}, ...]`` (bytes per rank, see :func:`model_state_bytes`). Raises ValueError for
    bad arguments (same rules as :func:`model_state_bytes`)."""
    return [{"stage": s, **model_state_bytes(num_params, dp, s, dtype, optimizer)} for s in STAGES]


def format_table(rows: list) -> str:
    """Render :func:`zero_table` rows as a fixed-width text table in decimal GB (1e9 bytes) per
    rank, 4 significant digits. Raises KeyError if a row lacks one of the byte keys."""
    cols = [("stage", "ZeRO stage"), ("params_bytes", "params GB"), ("grads_bytes", "grads GB"),
            ("optimizer_bytes", "optimizer GB"), ("total_bytes", "total GB")]
    lines = ["  ".join(f"{title:>12}" for _, title in cols)]
    for row in rows:
        cells = [f"{row['stage']:>12}"]
        cells += [f"{row[key] / GB:>12.4g}" for key, _ in cols[1:]]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _count(text: str) -> int:
    """argparse type: a non-negative integer count, also written like 7e9 or 7_000_000_000."""
    try:
        value = float(text.replace("_", "")) if any(c in text for c in ".eE") else int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(value)


def preset_num_params(name: str) -> int:
    """Parameter count of model preset ``name`` computed from its config with
    :func:`zerotron.analysis.flops.gpt_num_params` (nothing is allocated). Raises ValueError for an
    unknown preset (from ``zerotron.models.gpt.preset_config``)."""
    from zerotron.models.gpt import preset_config  # lazy: keeps torch out of the pure estimator

    cfg = preset_config(name)
    return gpt_num_params(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size,
                          bias=cfg.bias)


def memory_main(argv: list) -> int:
    """``zerotron memory [--model PRESET | --params N] --dp N [--dtype fp32|bf16-mixed]
    [--optimizer adam|sgd] [--json]``: print the ZeRO stage 0..3 model-state table (GB per rank)
    or, with ``--json``, ``{"num_params", "dp", "dtype", "optimizer", "stages": [rows in bytes]}``.
    Returns 0 on success, 2 on a usage or value error (message on stderr)."""
    parser = argparse.ArgumentParser(prog="zerotron memory",
                                     description="ZeRO model-state bytes per data-parallel rank.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model preset name (zerotron.models.gpt.PRESETS)")
    src.add_argument("--params", type=_count, help="parameter count, e.g. 7e9")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel degree N")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage/error on stderr
        return 0 if exc.code in (0, None) else 2
    try:
        num_params = preset_num_params(args.model) if args.model else args.params
        rows = zero_table(num_params, args.dp, args.dtype, args.optimizer)
    except (ValueError, ImportError) as exc:
        print(f"zerotron memory: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"num_params": num_params, "dp": args.dp, "dtype": args.dtype,
                          "optimizer": args.optimizer, "stages": rows}))
    else:
        print(f"{num_params:,} parameters, dp={args.dp}, {args.dtype}, {args.optimizer}: "
              f"model states per rank (ZeRO, Rajbhandari et al. 2020)")
        print(format_table(rows))
    return 0
