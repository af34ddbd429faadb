"""The values the plan's settings may take, and the one way a rule refuses (ConfigError, one line)."""
from __future__ import annotations

from ..config import ConfigError

DTYPES = ("fp32", "bf16", "fp64")  # = parallel.precision.TRAIN_DTYPES (no torch import here)
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp64")
DP_IMPLS = ("native", "torch")
CP_IMPLS = ("ring", "a2a", "allgather")  # = parallel.context.attention.IMPLS (no torch import here)
PP_SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
# schedules that place parallel.virtual_stages model stages on each rank (Megatron-LM's loop; ZB-V's V)
CHUNKED_SCHEDULES = ("interleaved", "zb-v")
RUNNERS = ("plain", "pipeline", "threads", "torch")
SYNCS = ("ddp", "torch_ddp", "zero", "fsdp2", "dtensor_tp")


def _need(cond, msg: str) -> None:
    """Raise ConfigError(msg) unless ``cond``: every rule of the plan refuses this way."""
    if not cond:
        raise ConfigError(msg)
