"""Distributed inference: batched, KV-cached generation on every layout (single, dp, tp, naive
model parallel, pipeline with micro-batches in flight, pp x tp), per-request sampling, the HTTP
server. See :mod:`zerotron.inference.engine`."""
from .batch import DecodeBatch, Request
from .engine import Engine, RunStats
from .sampling import SamplingParams

__all__ = ["Engine", "RunStats", "Request", "DecodeBatch", "SamplingParams"]
