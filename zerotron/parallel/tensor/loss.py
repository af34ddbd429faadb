"""Vocab-parallel cross-entropy (Shoeybi et al. 2019, "Megatron-LM", sec. 3): the loss of
vocabulary-sharded logits without gathering them — two all-reduces of B*T scalars instead of an
all-gather of B*T*V logits. Label smoothing over the full, unpadded vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zerotron.distributed import comm
from zerotron.parallel.precision import upcast
from zerotron.parallel.tensor.ops import _all_reduce


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, ignore_index, eps, tag):
        n_local = logits.size(-1)
        nv = max(0, min(n_local, vocab_size - vocab_start))  # real (unpadded) columns held here
        x = upcast(logits)[..., :nv]
        if nv:
            m = x.max(dim=-1).values
        else:
            m = torch.full(x.shape[:-1], float("-inf"), device=x.device)
        m = _all_reduce(m, group, tag, op=comm.ReduceOp.MAX)
        shifted = x - m.unsqueeze(-1)
        del x  # (an fp32 copy of bf16 logits): one (B, T, V_local) fp32 buffer from here on
        t = targets - vocab_start
        in_range = (t >= 0) & (t < nv)
        t_safe = t.clamp(0, max(nv - 1, 0))
        tgt = torch.zeros_like(m) if nv == 0 else shifted.gather(-1, t_safe.unsqueeze(-1)).squeeze(-1)
        smooth = [shifted.sum(-1)] if eps > 0 else []
        e = shifted.exp_()  # in place: the shifted logits are not needed any more
        stats = _all_reduce(torch.stack([e.sum(-1), torch.where(in_range, tgt, 0.0)] + smooth), group, tag)
        lse = stats[0].log()
        tok = (1.0 - eps) * (lse - stats[1])
        if eps > 0:
            tok = tok + eps * (lse - stats[2] / vocab_size)
        valid = targets != ignore_index
        ctx.save_for_backward(e.div_(stats[0].unsqueeze(-1)), t_safe, in_range, valid)  # the softmax, in place
        ctx.meta = (n_local, nv, eps, vocab_size, logits.dtype)
        return torch.where(valid, tok, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, t_safe, in_range, valid = ctx.saved_tensors
        n_local, nv, eps, vocab_size, dtype = ctx.meta
        g = softmax - eps / vocab_size if eps > 0 else softmax.clone()
        if nv:
            g.scatter_add_(-1, t_safe.unsqueeze(-1), -(1.0 - eps) * in_range.unsqueeze(-1).to(g.dtype))
        g.mul_((grad * valid).unsqueeze(-1))
        if n_local > nv:  # padding columns of the last vocabulary shard: zero gradient
            g = F.pad(g, (0, n_local - nv))
        return g.to(dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size_true: int, tp_group, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, tag: str = "tp_loss") -> torch.Tensor:
    """SUM over valid targets of the token cross-entropy, without gathering the logits.

    logits_local (B, T, V_local) holds columns [vocab_start, vocab_start + V_local) of the padded
    vocabulary (columns >= ``vocab_size_true`` are padding and never count); targets (B, T) int64.
    Method (Shoeybi et al. 2019, sec. 3, parallel cross-entropy): all-reduce MAX of the row maxima,
    then one all-reduce SUM of [sum_j exp(x_j - m), x_target - m (only on the owning rank),
    sum_j (x_j - m) if smoothing] -> 2 all-reduces of B*T(*3) floats. Per token:
    loss = (1-eps)(lse - x_y) + eps(lse - mean_j x_j), the mean over the true V (as
    ``F.cross_entropy(label_smoothing=eps)``). Backward is local: softmax - (1-eps) onehot - eps/V.
    Computed in fp32; returns an fp32 scalar equal on every tp rank (0 if no valid target).
    Raises ValueError on shape mismatch or eps outside [0, 1]."""
    if targets.shape != logits_local.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match logits {tuple(logits_local.shape)} "
                         "without the vocabulary dim")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    return _VocabParallelCE.apply(logits_local, targets, vocab_start, vocab_size_true, tp_group,
                                  ignore_index, float(label_smoothing), tag)
