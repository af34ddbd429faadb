"""Distributed inference: batched, KV-cached generation on every layout (single, dp, tp, naive
model parallel, pipeline with micro-batches in flight, pp x tp), per-request sampling, the HTTP
server. See :mod:`zerotron.inference.engine`.

The names below are imported on first use (PEP 562), so that ``zerotron.inference.request``
(torch-free: what the HTTP front-end process needs) can be imported without torch."""
from __future__ import annotations

import importlib

__all__ = ["Engine", "RunStats", "Request", "DecodeBatch", "SamplingParams"]

_HOME = {"Engine": ".engine", "RunStats": ".engine", "DecodeBatch": ".batch", "Request": ".request",
         "SamplingParams": ".request"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)
