"""A pipeline rank's gradients after the step's backward: the dp reduction waited for, the expert,
sequence-parallel and tied-weight sums, the global norm (tied weight counted once) and the optimizer
over this rank's stages (ZeRO: the driver's). Mixed into ``pipeline.runner.PipelineStrategy``."""
from __future__ import annotations

from zerotron.distributed import comm
from zerotron.parallel.base import unique_params
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.optim import build_optimizer
from zerotron.parallel.tensor.layers import is_tp_sharded
from zerotron.parallel.tensor.transform import sync_replicated_grads

__all__ = ["PipelineGradsMixin"]


class PipelineGradsMixin:
    """``parameters`` / ``finish_grads`` / ``clip_grad_norm`` / ``build_optimizer`` / ``optimizer_step`` and
    the state accounting for :class:`~zerotron.parallel.pipeline.runner.PipelineStrategy`; uses the
    attributes its constructor sets (``module``, ``zero``, ``ddp``, ``stage_sync``, ``tied``, ...)."""

    def parameters(self) -> list:
        """The optimizer's parameters: this rank's stage parameters, or ZeRO-1's fp32 master shards."""
        if self.zero is not None:
            return self.zero.parameters()
        return unique_params(self.module)

    def finish_grads(self) -> None:
        """Wait for the dp gradient reduction, then sum the tied embedding/head gradients between
        the first and last pipeline rank (pp > 1), so both copies get the same update. ZeRO: the
        driver's ``finish_grads`` (stage 1's reduce-scatters, HSDP's replica all-reduce, the tied and
        sequence-parallel sums of the shards in ``parallel.reduce_dtype``)."""
        if self.zero is not None:
            self.zero.finish_grads()
            return
        (self.ddp or self.stage_sync).finish_grads()  # waits for every reduction before the buffers are touched
        if self.experts is not None:  # expert shards: summed over the dp ranks holding the same experts
            self.experts.reduce_grads()
        self._sync_sp_replicated()
        if self.tied_group is not None and self.tied.requires_grad:  # FSDP2: both copies sharded alike over dp
            # (a frozen tied pair, LoRA's base, has no gradient: nothing to sum)
            g = self.tied.grad
            comm.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.tied_group, tag="pp_tied")

    def _sync_sp_replicated(self) -> None:
        """Sequence parallel (DDP path): LayerNorm/bias/wpe gradients saw one sequence shard: sum
        over tp. Must run on memory no collective is writing (after ``ddp.finish_grads`` waited)."""
        if self.module.sequence_parallel:
            sync_replicated_grads(self.module)

    def _norm_params(self) -> list:
        """This rank's parameters for the global norm, the tied copy of the last stage left out
        when the first stage (on another rank) counts it."""
        return [q for q in unique_params(self.module)
                if q.grad is not None and not (q is self.tied and self.last and not self.first)]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient L2 norm: sqrt of the sum of squares over the whole model (tied weight
        counted once); tensor parallel: squares of tp-sharded gradients all-reduced over tp,
        tp-replicated ones (equal on every tp rank) counted once; then all-reduced over pp.
        Identical on every rank. Clips in place (torch's formula, coef = max_norm / (norm + 1e-6)
        capped at 1) when ``max_norm > 0``, the tied copy included. Returns the norm before
        clipping. ZeRO: computed from the dp shards of the flat gradients (each element counted
        once, squares all-reduced over dp as well). One rule for every strategy:
        :func:`zerotron.parallel.grad_norm.clip_grad_norm`."""
        if self.zero is not None:  # the plain runner's rule over the shards, summed over pp too
            return self.zero.clip_grad_norm(max_norm, outer=[self.pp_group])
        counted = self._norm_params()
        extra = [q.grad for q in unique_params(self.module) if q.grad is not None and q is self.tied
                 and all(q is not c for c in counted)]
        shard = getattr(self.stage_sync, "shard_group", None)  # FSDP2: the dp shards are disjoint
        ex = self.experts.ids if self.experts is not None else frozenset()
        parts = [([q.grad for q in counted if is_tp_sharded(q) and id(q) not in ex], [shard, self.tp_group]),
                 ([q.grad for q in counted if not is_tp_sharded(q) and id(q) not in ex], [shard])]
        if ex:  # expert shards: disjoint over ep (tp-replicated)
            parts.append(([q.grad for q in counted if id(q) in ex], [self.experts.ep_group]))
        return clip_grad_norm(parts, max_norm, outer=[self.pp_group], also_clip=extra)

    def build_optimizer(self, tcfg, mask: dict):
        """AdamW over this rank's parameters; ``mask`` (decay by ``id(param)``) may come from the
        dense model or from ``self.module``; the tied copy is never decayed (an embedding)."""
        if self.zero is not None:  # decay flags were fixed per flat buffer at construction
            return self.zero.build_optimizer(tcfg)
        mask = dict(mask)
        if self.tied is not None:
            mask[id(self.tied)] = False
        return build_optimizer(self.parameters(), mask, tcfg)

    def optimizer_step(self, optimizer) -> None:
        if self.zero is not None:  # AdamW on the shards (per parameter where partly used), all-gather
            return self.zero.optimizer_step(optimizer)
        optimizer.step()

    def offload_timing(self) -> dict:
        """The ZeRO driver's host-copy and disk I/O seconds (``ZeroSync.offload_timing``); ``{}``
        without ZeRO offload."""
        return self.zero.offload_timing() if self.zero is not None else {}

    def model_state_bytes(self, optimizer) -> dict:
        """Bytes this rank holds (see ``Strategy.model_state_bytes``; ZeRO: the driver's count of its
        flat buffers, as the plain runner's)."""
        if self.zero is not None:
            return self.zero.model_state_bytes(optimizer)
        return super().model_state_bytes(optimizer)
