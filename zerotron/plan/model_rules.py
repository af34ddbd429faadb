"""The rules of a :class:`~zerotron.plan.ParallelPlan` (a mixin) that split the model itself: the
sequence over cp, heads and widths over tp, experts over ep, and document masks in the attention."""
from __future__ import annotations

from ..models.layout import a2a_refusal, tp_refusal
from .choices import CHUNKED_SCHEDULES, _need


class ModelRules:
    """The context-parallel, document-mask, tensor-parallel and expert rules of
    :class:`~zerotron.plan.ParallelPlan`; each raises ConfigError naming the setting and the fix."""

    def _check_context_parallel(self) -> None:
        """Context parallelism (``parallel.cp > 1``): the zigzag split of the sequence, the runners and
        features it composes with, and the all-to-all head rule (``models.layout.a2a_refusal``)."""
        cp = self.cp
        if cp == 1:
            return
        _need(self.runner in ("plain", "pipeline"),
              f"parallel.cp > 1 does not run with parallel.pp_impl = {self.pp_impl} (the {self.runner} runner "
              "reduces gradients over dp only); use parallel.pp_impl = native or parallel.cp = 1")
        if self.shape is None:
            return
        T = self.shape["block_size"]
        _need(T % (2 * cp) == 0,
              f"parallel.cp = {cp} needs model.block_size ({T}) divisible by 2*cp = {2 * cp} (each cp rank holds two "
              f"of 2*cp equal zigzag chunks of the training sequence); change model.block_size or parallel.cp")
        if self.cp_impl == "a2a":
            reason = a2a_refusal(cp, self.tp, self.shape)
            _need(reason is None, reason)

    def _check_doc_mask(self) -> None:
        """Document masking (``data.doc_mask``) needs a runner that hands each micro-batch's tokens to
        the attention of every stage (plain and the native pipeline executor) and attention that
        takes a mask (not torch's DTensor tensor parallelism)."""
        if not self.doc_mask:
            return
        _need(self.runner in ("plain", "pipeline"),
              f"data.doc_mask does not run with parallel.pp_impl = {self.pp_impl} (that runner does not pass each "
              "micro-batch's documents to its stages' attention); use parallel.pp_impl = native or data.doc_mask = false")
        _need(self.tp_impl == "native" or self.tp == 1,
              "data.doc_mask does not run with parallel.tp_impl = dtensor (torch's tensor parallelism; its attention "
              "takes no document mask); use parallel.tp_impl = native or data.doc_mask = false")

    def _check_tensor_parallel(self) -> None:
        """Head, kv-head, FFN and sequence divisibility; the DTensor comparison backend's limits."""
        tp = self.tp
        _need(tp > 1 or not self.sequence_parallel,
              "parallel.sequence_parallel shards activations along the sequence over the tp ranks and needs "
              "parallel.tp > 1: set parallel.tp, or remove parallel.sequence_parallel")
        _need(tp > 1 or self.tp_impl == "native",
              "parallel.tp_impl = dtensor chooses torch's tensor parallelism and needs parallel.tp > 1: set "
              "parallel.tp, or remove parallel.tp_impl")
        if self.tp_impl == "dtensor" and tp > 1:
            _need(self.dp == 1 and self.pp == 1 and self.cp == 1 and self.zero_stage == 0 and not self.sequence_parallel
                  and self.pp_schedule not in CHUNKED_SCHEDULES,
                  "parallel.tp_impl = dtensor (the torch comparison backend) runs tensor parallelism alone: dp = pp "
                  "= cp = 1, zero_stage = 0, sequence_parallel = false; use tp_impl = native to combine tp with the rest")
            _need(self.dropout == 0, "parallel.tp_impl = dtensor needs model.dropout = 0 (replicated-region "
                  "dropout masks would differ across tp ranks); use tp_impl = native for dropout")
        if self.shape is None:
            return
        s = self.shape  # heads, kv heads, MLP width, block_size under SP: the one rule (models.layout)
        # under cp, sequence parallelism splits this rank's T / cp tokens (cp outside tp)
        reason = tp_refusal(tp, s, s["block_size"] // self.cp if self.sequence_parallel else None)
        _need(reason is None, reason)


    def _check_experts(self) -> None:
        """Mixture-of-experts models (``shape["n_experts"]``) and expert parallelism (``parallel.ep``,
        carved out of the batch group dp x cp: ``zerotron.parallel.expert``). The router's auxiliary losses are taken over
        each micro-batch's tokens: under sequence (context) parallelism each tp (cp) rank routes its
        sequence shard and the statistics are summed over tp (cp) (``models.layout.add_token_sum``); capacity mode, which
        caps each forward's own assignments, is refused there rather than changing what is dropped."""
        ep, moe = self.ep, self.shape is not None and bool(self.shape.get("n_experts"))
        _need(isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1, f"parallel.ep must be an int >= 1, got {ep!r}")
        if moe:
            _need(not ((self.sequence_parallel or self.cp > 1) and self.shape.get("moe_capacity_factor")),
                  "model.moe_capacity_factor with parallel.sequence_parallel or parallel.cp > 1 is not supported (each "
                  "rank would cap the assignments of its sequence shard only); set model.moe_capacity_factor = 0 "
                  "(dropless), or parallel.sequence_parallel = false and parallel.cp = 1")
            _need(not (self.tp > 1 and self.tp_impl == "dtensor"),
                  "parallel.tp_impl = dtensor does not know the MoE layers; use parallel.tp_impl = native")
        if ep == 1:
            return
        _need(self.shape is None or moe,
              f"parallel.ep = {ep} splits the experts of a mixture-of-experts model, and this model has none; set "
              "model.arch = 'mixtral' or parallel.ep = 1")
        batch = self.dp * self.cp
        _need(batch % ep == 0,
              f"parallel.ep ({ep}) must divide the batch degree dp x cp ({self.dp} x {self.cp}): the ep group is carved "
              "out of the ranks holding different tokens of the batch; change parallel.ep or the world size")
        if moe:
            E = self.shape["n_experts"]
            _need(E % ep == 0, f"parallel.ep ({ep}) must divide model.n_experts ({E}): each ep rank holds E/ep whole "
                               "experts; change parallel.ep or model.n_experts")
        _need(self.runner in ("plain", "pipeline"),
              "parallel.ep > 1 runs on the plain runner and the native pipeline executor (parallel.pp_impl threads / "
              "torch do not shard experts); set parallel.pp_impl = native, or parallel.ep = 1")
        _need(self.dp_shard * self.cp % ep == 0,
              f"parallel.ep ({ep}) must divide the shard degree dp / dp_replicate x cp ({self.dp_shard} x {self.cp}) "
              "under HSDP: each ep group lies inside one shard group; change parallel.ep or parallel.dp_replicate")
        _need(self.dp_replicate == 1 or self.sync != "fsdp2",
              "parallel.ep > 1 with FSDP2's HSDP (parallel.dp_replicate > 1, zero_impl = fsdp2) is not supported (the "
              "experts would need a 2-D mesh of their own); set parallel.zero_impl = native (native HSDP runs "
              "with ep) or parallel.dp_replicate = 1")
        _need(self.runner == "plain" or (self.dp_replicate == 1 and self.sync in ("ddp", "zero")),
              "parallel.ep > 1 under a pipeline composes with native DDP and native ZeRO-1/2/3 without HSDP so far "
              "(torch DDP, FSDP2 and dp_replicate > 1 take experts on the plain runner only); set parallel.pp = 1, or "
              "parallel.dp_impl = native, parallel.zero_impl = native and parallel.dp_replicate = 1")
