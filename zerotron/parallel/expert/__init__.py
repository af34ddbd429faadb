"""Expert parallelism (``parallel.ep``): the experts of each MoE layer divided over ep ranks carved
out of the data-parallel group, tokens carried to their experts and back by all-to-all.

  * :mod:`.dispatch`: the router-agnostic dispatch/combine installed as each MoE layer's
    ``dispatch`` hook (``models.layout.ExpertLayout``): counts first, then the uneven payload;
  * :mod:`.strategy`: :class:`ExpertDataParallel` (native DDP) and :class:`ExpertZero` (native
    ZeRO-1/2/3) for the non-expert parameters over dp, the expert parameters sharded over ep and summed
    over dp/ep.
"""
from zerotron.parallel.expert.dispatch import AllToAllDispatch, shard_experts
from zerotron.parallel.expert.strategy import ExpertDataParallel, ExpertZero, expert_groups

__all__ = ["AllToAllDispatch", "shard_experts", "ExpertDataParallel", "ExpertZero", "expert_groups"]
