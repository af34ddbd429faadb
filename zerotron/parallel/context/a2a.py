"""All-to-all ("Ulysses") context attention (Jacobs et al., "DeepSpeed Ulysses: System
Optimizations for Enabling Training of Extreme Long Sequence Transformer Models", 2023).

Each cp rank holds every head of its T/cp tokens (the zigzag split of :mod:`.split`). One
all-to-all per tensor re-shards q, k and v from sequence-sharded (B, H, T/cp, D) to head-sharded
(B, H/cp, T, D) -- rank r receives heads r*H/cp .. (r+1)*H/cp - 1 of every rank's tokens, put back
in natural sequence order with :func:`.split.unsplit_order` -- then runs ordinary causal attention
over the whole sequence for its heads, and a second all-to-all re-shards the output back to
sequence-sharded. The backward is the same in reverse: the adjoint of an all-to-all is the reverse
all-to-all (and the adjoint of a permutation its inverse).

Grouped-query attention (Ainslie et al. 2023): cp must divide the kv heads H_kv; rank r takes kv
heads r*H_kv/cp .. and the H/cp query heads that use them (query head h uses kv head h // (H/H_kv)),
so only the kv heads travel. Volume per rank and direction: each all-to-all moves its input's bytes
(the accounting counts the input), (cp-1)/cp of them off the rank.
"""
from __future__ import annotations

import torch

from zerotron.distributed import comm
from zerotron.distributed.groups import process_group
from zerotron.models.attn_dropout import AttnDropout, coordinate_attention
from zerotron.models.base import causal_attention

from .documents import doc_attention
from .split import unsplit_order

__all__ = ["a2a_attention", "heads_to_seq", "seq_to_heads"]


def _size(group) -> int:
    return torch.distributed.get_world_size(process_group(group))


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, N, T/cp, D) sequence shard -> (B, N/cp, T, D) head shard in natural sequence order."""
    cp = _size(group)
    B, N, t, D = x.shape
    send = x.reshape(B, cp, N // cp, t, D).transpose(0, 1).contiguous()  # piece j: heads for rank j
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group, tag="cp_a2a")  # recv[j]: rank j's tokens of my heads
    gathered = recv.permute(1, 2, 0, 3, 4).reshape(B, N // cp, cp * t, D)  # rank-order concatenation
    return gathered.index_select(2, unsplit_order(cp * t, cp, device=x.device))


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, N/cp, T, D) head shard in natural order -> (B, N, T/cp, D) this rank's sequence shard."""
    cp = _size(group)
    B, n, T, D = x.shape
    order = unsplit_order(T, cp, device=x.device)
    ranked = torch.empty_like(x).index_copy_(2, order, x)  # natural -> rank-order concatenation
    send = ranked.reshape(B, n, cp, T // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # piece j: rank j's tokens
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group, tag="cp_a2a")  # recv[j]: my tokens of rank j's heads
    return recv.transpose(0, 1).reshape(B, cp * n, T // cp, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.group), None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all re-shard over the cp ``group``: x (B, N, T/cp, D), this rank's zigzag
    tokens of all N heads -> (B, N/cp, T, D), heads cp_rank*N/cp .. of every token in natural order.
    Counted as ``all_to_all`` with tag ``cp_a2a`` (x's bytes). N must be divisible by cp."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse (and adjoint) of :func:`seq_to_heads`: (B, N/cp, T, D) -> (B, N, T/cp, D)."""
    return _HeadsToSeq.apply(x, group)


def _attend(q, k, v, doc, drop):
    """Attention over the whole sequence (natural order) of the heads in hand: causal, document
    masked with ``doc``, and with coordinate dropout ``drop`` (heads offset by the caller)."""
    if drop is None:
        return causal_attention(q, k, v, 0.0) if doc is None else doc_attention(q, k, v, doc.to(q.device), 0.0)
    if doc is not None:
        return doc_attention(q, k, v, doc.to(q.device), drop=drop)
    t = torch.arange(q.size(2), device=q.device)
    return coordinate_attention(q, k, v, t[None, :] <= t[:, None], drop, t, t)


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, doc: torch.Tensor | None = None,
                  drop: AttnDropout | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's zigzag tokens over the whole sequence by all-to-all head
    re-sharding (module doc): q (B, H, T_local, D), k and v (B, H_kv, T_local, D) -> (B, H, T_local, D),
    row for row equal to causal scaled dot-product attention over the full sequence
    (``models.base.causal_attention``). Differentiable in q, k and v.

    Traffic per rank, forward (and the same again in the backward): four ``all_to_all`` calls with
    tag ``cp_a2a`` over ``group``, of q's, k's, v's and the output's bytes.
    ``doc``: None, or the document indices (B, T) of the whole sequence (natural order): the
    attention over the re-sharded sequence is then document-masked (``docmask.doc_attention``).
    ``drop``: None, or the attention dropout of this call (``models.attn_dropout.AttnDropout``, key
    shared by the cp group): after the re-shard this rank holds query heads cp_rank*H/cp .., so its
    coordinate mask is taken with the head offset shifted by that much (plain torch attention).
    Raises ValueError when cp does not divide H_kv (the plan refuses such a layout first)."""
    cp = _size(group)
    H, Hkv = q.size(1), k.size(1)
    if Hkv % cp or H % Hkv:
        raise ValueError(f"all-to-all context attention needs cp ({cp}) to divide the kv heads ({Hkv}); "
                         "use parallel.cp_impl = 'ring' or a cp that divides them")
    if cp == 1:
        return _attend(q, k, v, doc, drop)
    rank = torch.distributed.get_rank(process_group(group))
    drop = drop.shifted(rank * (H // cp)) if drop is not None else None
    out = _attend(seq_to_heads(q.contiguous(), group), seq_to_heads(k.contiguous(), group),
                  seq_to_heads(v.contiguous(), group), doc, drop)
    return heads_to_seq(out.contiguous(), group)
