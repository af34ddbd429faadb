"""All-gather context-parallel attention (Llama 3, Dubey et al. 2024, section 3.3.2).

Every cp rank all-gathers the keys and values of the whole sequence (K and V are small next to the
queries under grouped-query attention), puts them back in natural order (``split.unsplit_order``)
and attends with its local queries, masked by their *global* positions: query at global position p
sees keys 0 .. p. The backward reduce-scatters dK and dV, so each rank receives the summed gradient
of its own keys and values from every rank's queries. Memory: the full K and V (B, H_kv, T, D) per
layer live for the backward; no overlap of communication and compute (the ring implementation has
that). Exact: every row is the same softmax over the same keys as one process computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zerotron.distributed import comm
from zerotron.models.attn_dropout import AttnDropout, coordinate_attention
from zerotron.parallel.context.documents import allowed_mask
from zerotron.parallel.context.split import unsplit_order, zigzag_positions

__all__ = ["allgather_attention"]

TAG = "cp_attn"


class _GatherSequence(torch.autograd.Function):
    """kv (2, B, H_kv, T_local, D) -> (cp, 2, B, H_kv, T_local, D): every cp rank's block, in rank
    order (one all-gather over ``group``); backward: the incoming gradient reduce-scattered over
    ``group``, so each rank gets the sum of every rank's gradient of its own block."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        kv = kv.contiguous()
        n = group.size()
        out = torch.empty(n * kv.numel(), dtype=kv.dtype, device=kv.device)
        comm.all_gather(out, kv, group=group, tag=TAG)
        return out.view(n, *kv.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter(out, grad.reshape(-1), group=ctx.group, tag=TAG)
        return out, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                        doc: torch.Tensor | None = None, drop: AttnDropout | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's zigzag chunks against the whole sequence (the contract of
    :mod:`.attention`): q (B, H, T_local, D), k/v (B, H_kv, T_local, D), H a multiple of H_kv ->
    (B, H, T_local, D), scale 1/sqrt(D). ``group``: the cp group (a ``comm.NamedGroup``); traffic:
    one all-gather of K and V per call and one reduce-scatter of their gradients in backward,
    tagged "cp_attn". ``doc``: None, or the document indices (B, T) of the whole sequence in natural
    order (``.docmask``): keys of other documents are masked too. ``drop``: None, or the attention
    dropout of this call (``models.attn_dropout.AttnDropout``, key shared by the cp group): the
    coordinate mask at the queries' zigzag positions against all keys (plain torch attention). Raises ValueError when q, k, v disagree in batch, length or head dim."""
    B, H, Tl, D = q.shape
    if k.shape != v.shape or k.size(0) != B or k.size(2) != Tl or k.size(3) != D or H % k.size(1):
        raise ValueError(f"allgather_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         "match (B, H, T_local, D) / (B, H_kv, T_local, D) with H a multiple of H_kv")
    cp, rank = group.size(), group.rank()
    T, Hkv = Tl * cp, k.size(1)
    blocks = _GatherSequence.apply(torch.stack([k, v]), group)  # (cp, 2, B, H_kv, T_local, D)
    full = blocks.permute(1, 2, 3, 0, 4, 5).reshape(2, B, Hkv, T, D)  # rank-major slots
    full = full.index_select(3, unsplit_order(T, cp, device=q.device))  # natural order 0 .. T-1
    kf, vf = full[0], full[1]
    if Hkv != H:  # grouped-query attention: each kv head serves H / H_kv query heads
        kf, vf = kf.repeat_interleave(H // Hkv, dim=1), vf.repeat_interleave(H // Hkv, dim=1)
    qpos = zigzag_positions(T, cp, rank, device=q.device)
    if doc is None:
        mask = torch.arange(T, device=q.device)[None, :] <= qpos[:, None]  # (T_local, T)
    else:  # (B, 1, T_local, T): same document and not in the future
        doc = doc.to(q.device)
        mask = allowed_mask(doc.index_select(1, qpos), doc, qpos, torch.arange(T, device=q.device))
    if drop is not None:
        return coordinate_attention(q, kf, vf, mask, drop, qpos, torch.arange(T, device=q.device))
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask)
