"""Precision modes: which torch dtype parameters, compute, gradient collectives and optimizer
state use for a ``train.dtype`` / ``parallel.reduce_dtype`` pair.

| train.dtype | parameters, master weights, optimizer state | compute (autocast) | reduce_dtype "auto" |
|---|---|---|---|
| fp32 | float32 | float32 | float32 |
| bf16 | float32 (ZeRO: bf16 compute copies, fp32 master shards) | bfloat16 | float32 |
| fp64 | float64 | float64 | float64 |

fp64 is the numerics-debugging mode: reassociation noise is ~1e-16, so a correct layout agrees
with one process to ~1e-12 on any CPU, while a wrong one differs by far more (the parity matrix,
``zerotron.parity``, relies on it). CPU torch and gloo support float64 for every op zerotron uses.
"""
from __future__ import annotations

import torch

TRAIN_DTYPES = ("fp32", "bf16", "fp64")
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp64")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def param_dtype(train_dtype: str) -> torch.dtype:
    """Storage dtype of parameters, master weights and optimizer state: float64 for "fp64", else
    float32. Raises ValueError for an unknown mode."""
    _check(train_dtype, TRAIN_DTYPES, "train.dtype")
    return torch.float64 if train_dtype == "fp64" else torch.float32


def compute_dtype(train_dtype: str) -> torch.dtype:
    """dtype of forward/backward math (bf16 under autocast, else the parameter dtype)."""
    _check(train_dtype, TRAIN_DTYPES, "train.dtype")
    return TORCH_DTYPES[train_dtype]


def reduce_dtype(train_dtype: str, reduce: str = "auto") -> torch.dtype:
    """dtype of every gradient collective: ``reduce`` ("fp32" | "bf16" | "fp64"), or for "auto"
    the parameter dtype of ``train_dtype``. Raises ValueError for unknown names."""
    _check(reduce, REDUCE_DTYPES, "parallel.reduce_dtype")
    return param_dtype(train_dtype) if reduce == "auto" else TORCH_DTYPES[reduce]


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (float64 stays float64): for losses and norms."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _check(value: str, allowed: tuple, key: str) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
