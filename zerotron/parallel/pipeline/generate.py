"""Greedy decoding through a training pipeline without a KV cache (``pp-nocache`` of ``bench
generate``, the checks of ``tests/test_pipeline.py``): every token recomputes the window through
the stages. The KV-cached engine is ``zerotron.inference.pipelined``."""
from __future__ import annotations

import torch

from zerotron.distributed import comm
from zerotron.parallel.tensor.transform import gather_logits, set_sequence_parallel

__all__ = ["pipeline_generate"]


@torch.no_grad()
def pipeline_generate(strategy, idx: torch.Tensor, max_new_tokens: int,
                      dtype: str = "fp32") -> torch.Tensor:
    """Pipelined greedy decoding with a ``PipelineStrategy``: idx (B, T0) int64 (the same on every pp rank of a dp coordinate)
    -> (B, T0 + max_new_tokens) on every pp rank. No KV cache: each token recomputes the last
    ``block_size`` positions through the stages; the last stage takes the argmax and broadcasts it
    over the pp group. Equals ``CausalLM.generate(idx, n, temperature=0)`` of the dense model.
    Raises ValueError for an empty prompt or max_new_tokens < 0."""
    if idx.dim() != 2 or idx.size(1) == 0 or max_new_tokens < 0:
        raise ValueError(f"need idx (B, T0) with T0 >= 1 and max_new_tokens >= 0, got "
                         f"{tuple(idx.shape)}, {max_new_tokens}")
    mod = strategy.module
    was_training, sp = mod.training, mod.sequence_parallel
    mod.eval()
    if sp:  # prompt lengths need not divide by tp: decode without sequence parallelism
        set_sequence_parallel(mod, False)
    device = idx.device
    src = strategy._peer(strategy.last_rank)  # the pp rank of the last model stage (0 under zb-v)
    for _ in range(max_new_tokens):
        ctx = idx[:, -mod.config.block_size:]  # the model config's context length
        nxt = torch.empty(idx.size(0), 1, dtype=torch.long, device=device)

        def on_output(mb, logits):
            if strategy.tp_group is not None:  # vocab shards -> full logits (collective over tp)
                logits = gather_logits(logits[:, -1:, :], mod.config.vocab_size, strategy.tp_group)
            nxt.copy_(logits[:, -1, :].float().argmax(dim=-1, keepdim=True))

        strategy._forward_only(ctx, on_output, dtype, device)
        if strategy.pp > 1:
            comm.broadcast(nxt, src=src, group=strategy.pp_group, tag="generate")
        idx = torch.cat([idx, nxt], dim=1)
    mod.train(was_training)
    if sp:
        set_sequence_parallel(mod, True)
    return idx
