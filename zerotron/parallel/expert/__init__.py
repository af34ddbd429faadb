"""Expert parallelism (``parallel.ep``): the experts of each MoE layer divided over ep ranks carved
out of the data-parallel group, tokens carried to their experts and back by all-to-all.

  * :mod:`.dispatch`: the router-agnostic dispatch/combine installed as each MoE layer's
    ``dispatch`` hook (``models.layout.ExpertLayout``): counts first, then the uneven payload;
  * :mod:`.strategy`: :class:`ExpertDataParallel` (native DDP), :class:`ExpertTorchDDP` (torch DDP)
    and :class:`ExpertZero` (native ZeRO-1/2/3; HSDP for both natives) for the non-expert parameters
    over dp, the expert parameters sharded over ep and summed over dp/ep;
  * :mod:`.fsdp`: :class:`ExpertFSDP2` (torch FSDP2, the experts ``fully_shard``-ed over dp/ep).
"""
from zerotron.parallel.expert.dispatch import AllToAllDispatch, shard_experts
from zerotron.parallel.expert.fsdp import ExpertFSDP2
from zerotron.parallel.expert.strategy import ExpertDataParallel, ExpertTorchDDP, ExpertZero, expert_groups

__all__ = ["AllToAllDispatch", "shard_experts", "ExpertDataParallel", "ExpertTorchDDP", "ExpertZero",
           "ExpertFSDP2", "expert_groups"]
