"""Ring attention: causal attention over a sequence split across the cp ranks, the key/value blocks
travelling around the ring while each rank keeps its queries (Liu, Zaharia and Abbeel, "Ring
Attention with Blockwise Transformers for Near-Infinite Context", 2023).

Forward. cp rank r holds its queries, keys and values (the zigzag split of :mod:`.split`, or a
contiguous split). In step s = 0 .. cp-1 it holds the K/V block of rank (r - s) mod cp; before
computing with it, it posts the transfer of that block to rank r+1 and the receive of the next one
from rank r-1 (one ``comm.batch_isend_irecv``), so the transfer overlaps the block's attention. Each
(query block, key block) result is a partial softmax, merged into the running output with the
log-sum-exp rule (:func:`merge`; the online softmax of Milakov and Gimelshein 2018, as in
FlashAttention, Dao et al. 2022). Only the H_kv kv heads travel; grouped-query attention
(Ainslie et al. 2023) expands them locally by viewing the H = H_kv * rep query heads as
(H_kv, rep) groups.

Backward (the standard ring backward, e.g. ring-flash-attention and Megatron-LM's context
parallelism): a second rotation of K/V; each rank recomputes the probabilities of a block from the
saved per-row log-sum-exp (FlashAttention's backward, Dao et al. 2022), adds dQ locally and adds
the block's dK/dV into accumulators that travel with their K/V; after cp hops the accumulators are
home, at the rank that owns those keys.

Masking works at chunk granularity with global positions: a rank's local sequence is a list of
equal-size chunks with global chunk indices (zigzag: chunks r and 2cp-1-r of 2cp; contiguous: chunk
r of cp). A (query chunk i, key chunk j) pair is fully visible (i > j), diagonal (i == j: causal
within the chunk) or fully masked (i < j: skipped, no compute). Under the zigzag split every rank
computes 2 diagonal and 2cp-1 full (C x C) pairs, the same work on every rank; under the contiguous
split rank r computes r full pairs and one diagonal one (of size (T/cp)^2), so the last rank does
about (2cp-1)x the first one's work.

Per-block kernels. A block without a document mask runs torch's fused attention kernel with its
log-sum-exp (on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which
takes the *merged* output and log-sum-exp, as FlashAttention's backward does): no (C x C) score
matrix is materialised, a diagonal block skips its masked half, and grouped-query heads are read in
place. A block with a document mask or attention dropout (``models.attn_dropout``: the mask a
function of the block's global coordinates, regenerated in the backward) runs plain torch (matmul,
exp, masks). Both in fp32 for
bf16/fp16 inputs and in the input dtype otherwise (autocast is switched off inside), so fp64 results
equal single-process attention to rounding.
"""
from __future__ import annotations

import math
import time

import torch
from torch.autograd.function import once_differentiable

from zerotron.distributed import comm
from zerotron.distributed.groups import group_ranks, process_group
from zerotron.models.attn_dropout import AttnDropout, apply_keep

from .documents import allowed_mask
from .split import check_split

__all__ = ["LAYOUTS", "chunk_layout", "merge", "rank_work", "ring_attention"]

LAYOUTS = ("zigzag", "contiguous")


def chunk_layout(layout: str, cp: int, rank: int, t_local: int) -> tuple[int, list[int]]:
    """``(chunk_size, chunk_ids)``: the global chunk indices of cp rank ``rank``'s local sequence (in
    local order) and their common size, for a local length ``t_local``. ``"zigzag"``: chunks
    (rank, 2cp-1-rank) of size t_local/2; ``"contiguous"``: chunk ``rank`` of size t_local.
    Raises ValueError for an unknown layout or an odd zigzag local length."""
    if layout == "zigzag":
        check_split(t_local * cp, cp)
        return t_local // 2, [rank, 2 * cp - 1 - rank]
    if layout == "contiguous":
        return t_local, [rank]
    raise ValueError(f"unknown ring attention layout {layout!r}; choose one of {LAYOUTS}")


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's partial attention into a running one with the log-sum-exp rule.

    ``out``/``block_out`` (..., T, D) are softmax-normalised outputs over disjoint key sets, ``lse``/
    ``block_lse`` (..., T) the log-sum-exp of their scaled scores; the result is the output and lse
    over the union: lse' = log(e^lse + e^block_lse), out' = out e^(lse-lse') + block_out
    e^(block_lse-lse'). ``out is None`` (nothing yet) returns the block. A row may have lse = -inf
    (no key seen yet: document masking) as long as its output there is 0; it stays so while both
    are -inf (every query row sees at least itself by the end)."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(torch.isinf(new), 0.0)  # rows with nothing seen yet: weights exp(-inf) = 0
    return out * torch.exp(lse - ref).unsqueeze(-1) + block_out * torch.exp(block_lse - ref).unsqueeze(-1), new


def _scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool, scale: float,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled scores (B, H_kv, rep, Tq, Tk) of grouped queries q (B, H_kv, rep, Tq, D) against keys
    k (B, H_kv, Tk, D); -inf above the diagonal when ``diagonal`` (query chunk == key chunk), or,
    when given, wherever the boolean ``allowed`` (B, 1, Tq, Tk) (document masking) is False."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed[:, :, None], float("-inf"))
    elif diagonal:
        tq, tk = s.shape[-2:]
        future = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _fused(q: torch.Tensor):
    """(forward, backward) of torch's fused attention kernel with log-sum-exp for q's device, or
    None where torch has none (then blocks run plain torch)."""
    ops = torch.ops.aten
    if q.device.type == "cpu" and hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        return (ops._scaled_dot_product_flash_attention_for_cpu,
                ops._scaled_dot_product_flash_attention_for_cpu_backward)
    return None


def _grouped(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, H_kv, rep, T, D): query head h belongs to kv head h // rep."""
    b, h, n, d = t.shape
    return t.reshape(b, hkv, h // hkv, n, d)


def _block_forward(q, k, v, diagonal: bool, scale: float, allowed=None, keep=None, p: float = 0.0):
    """One (query chunk, key chunk) block: q (B, H, C, D), k and v (B, H_kv, C, D) ->
    (softmax output (B, H, C, D), log-sum-exp of the scaled scores (B, H, C)); causal within
    the block when ``diagonal``; masked by ``allowed`` (B, 1, C, C) when given (-inf lse and a
    zero output on a row with no allowed key). ``keep`` (B, H_kv, rep, C, C) bool: attention
    dropout ``p`` (``models.attn_dropout``) on the block's probabilities, the lse staying the one of
    the undropped scores (so the log-sum-exp merge of dropped blocks is exact)."""
    fused = _fused(q)
    if fused is not None and allowed is None and keep is None:
        out, lse = fused[0](q, k, v, 0.0, diagonal, scale=scale)
        return out, lse
    hkv = k.size(1)
    s = _scores(_grouped(q, hkv), k, diagonal, scale, allowed)
    lse = torch.logsumexp(s, dim=-1)  # -inf on a row that sees no key of this block
    probs = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    if keep is not None:
        probs = apply_keep(probs, keep, p)
    out = torch.matmul(probs, v.unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _block_backward(dout, q, k, v, out, lse, delta, diagonal: bool, scale: float, allowed=None, keep=None,
                    p: float = 0.0):
    """Gradients (dq (B, H, C, D), dk, dv (B, H_kv, C, D)) of one block's share of the loss, given
    the *merged* output ``out`` (B, H, C, D) and log-sum-exp ``lse`` (B, H, C) of its query rows and
    ``delta`` = rowsum(dout * out) (B, H, C) (FlashAttention's backward, Dao et al. 2022). With
    dropout (``keep``, ``p``): dV from the dropped probabilities, dP masked and scaled like them,
    and delta unchanged (rowsum(dP_dropped * P_dropped) = rowsum(dout * out), as FlashAttention's
    dropout backward uses)."""
    fused = _fused(q)
    if fused is not None and allowed is None and keep is None:
        dq, dk, dv = fused[1](dout, q, k, v, out, lse, 0.0, diagonal, scale=scale)
        return dq, dk, dv
    hkv = k.size(1)
    qg, dog = _grouped(q, hkv), _grouped(dout, hkv)
    probs = torch.exp(_scores(qg, k, diagonal, scale, allowed) - _grouped(lse.unsqueeze(-1), hkv))
    kb, vb = k.unsqueeze(2), v.unsqueeze(2)  # (B, H_kv, 1, C, D): broadcast over the rep query heads
    dprobs = torch.matmul(dog, vb.transpose(-1, -2))
    dropped = probs
    if keep is not None:
        dropped, dprobs = apply_keep(probs, keep, p), apply_keep(dprobs, keep, p)
    ds = probs * (dprobs - _grouped(delta.unsqueeze(-1), hkv))
    dq = (torch.matmul(ds, kb) * scale).flatten(1, 2)
    dk = (torch.matmul(ds.transpose(-1, -2), qg) * scale).sum(2)
    dv = torch.matmul(dropped.transpose(-1, -2), dog).sum(2)
    return dq, dk, dv


def _pairs(q_ids: list[int], k_ids: list[int]):
    """The (query chunk slot, key chunk slot, diagonal) pairs that are not fully masked."""
    return [(a, b, qi == kj) for a, qi in enumerate(q_ids) for b, kj in enumerate(k_ids) if qi >= kj]


def rank_work(layout: str, cp: int, rank: int) -> int:
    """The attention work cp rank ``rank`` does in a ring forward (the backward does the same
    pairs), in (T/(2cp)) x (T/(2cp)) score blocks: the sizes of the (query chunk, key chunk) pairs
    it computes, fully masked pairs skipped and diagonal ones computed whole. zigzag: 2cp + 1 on
    every rank; contiguous: 4(rank + 1)."""
    t_local = 2  # in units of T/(2cp)
    chunk, mine = chunk_layout(layout, cp, rank, t_local)
    return sum(chunk * chunk * len(_pairs(mine, chunk_layout(layout, cp, src, t_local)[1])) for src in range(cp))


class _Ring:
    """Who is where on the cp ring: size, this rank's index, the global ranks of the next and
    previous peers, and the chunk layout of every rank."""

    def __init__(self, group, layout: str, t_local: int, doc: torch.Tensor | None = None,
                 drop: AttnDropout | None = None, device=None):
        pg = process_group(group)
        self.group = group
        self.size = torch.distributed.get_world_size(pg)
        self.rank = torch.distributed.get_rank(pg)
        ranks = group_ranks(group) or list(range(self.size))
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self.layout, self.t_local = layout, t_local
        self.chunk, _ = chunk_layout(layout, self.size, self.rank, t_local)
        self.doc = doc  # (B, T) document indices of the whole sequence, or None
        self.drop, self.device = drop, device  # attention dropout (key, first row and head), or None
        self.events = None  # with timings: {"posts": [t], "waits": [(post index, start, end)]} (see _wait)

    def allowed(self, qi: int, kj: int) -> torch.Tensor | None:
        """Document masking: the boolean mask (B, 1, C, C) of global query chunk ``qi`` against key
        chunk ``kj`` (same document and not in the future), or None without documents."""
        if self.doc is None:
            return None
        dev = self.doc.device
        q = torch.arange(qi * self.chunk, (qi + 1) * self.chunk, device=dev)
        k = torch.arange(kj * self.chunk, (kj + 1) * self.chunk, device=dev)
        return allowed_mask(self.doc[:, q], self.doc[:, k], q, k)

    def keep(self, qi: int, kj: int, B: int, H: int, hkv: int) -> torch.Tensor | None:
        """Attention dropout: the keep mask (B, H_kv, H/H_kv, C, C) of global query chunk ``qi``
        against key chunk ``kj`` (``models.attn_dropout.keep_mask`` at the chunks' global positions,
        grouped like the queries), or None without dropout."""
        if self.drop is None:
            return None
        dev = self.device
        q = torch.arange(qi * self.chunk, (qi + 1) * self.chunk, device=dev)
        k = torch.arange(kj * self.chunk, (kj + 1) * self.chunk, device=dev)
        keep = self.drop.keep(B, H, q, k)
        return keep.view(B, hkv, H // hkv, self.chunk, self.chunk)

    def blocks(self, step: int, B: int = 0, H: int = 0, hkv: int = 1):
        """(query slot, key slot, diagonal, allowed mask, keep mask) of the block pairs this rank
        computes at ``step``: causally visible, and with documents at least one allowed score; the
        keep mask (dropout, for B rows and H query heads over hkv kv heads) or None."""
        mine, theirs = self.ids(self.rank), self.ids(self.source(step))
        for a, b, diag in _pairs(mine, theirs):
            allowed = self.allowed(mine[a], theirs[b])
            if allowed is None or bool(allowed.any()):
                yield a, b, diag, allowed, self.keep(mine[a], theirs[b], B, H, hkv)

    def ids(self, rank: int) -> list[int]:
        """The global chunk indices of cp rank ``rank``'s local sequence."""
        return chunk_layout(self.layout, self.size, rank, self.t_local)[1]

    def source(self, step: int) -> int:
        """The cp rank whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def shift(self, t: torch.Tensor, tag: str):
        """Post send of ``t`` to the next rank and receive of a same-shape tensor from the previous:
        ``(received buffer, works)``; wait on the works before reading the buffer."""
        buf = torch.empty_like(t)
        works = _Posted(comm.batch_isend_irecv([("send", t, self.next), ("recv", buf, self.prev)], group=self.group,
                                               tag=tag))
        if self.events is not None:  # the i-th post of every rank is the same hop (same code path on each)
            works.index = len(self.events["posts"])
            works.events = self.events
            self.events["posts"].append(time.perf_counter())
        return buf, works

    def slot(self, i: int) -> slice:
        return slice(i * self.chunk, (i + 1) * self.chunk)


class _Posted(list):
    """The works of one :meth:`_Ring.shift` (a list), with the hop's ``index`` among this rank's
    posts and the ring's ``events`` when its timings are traced."""

    index, events = None, None


def _wait(works) -> float:
    """Wait for the works; the seconds spent waiting (transfer time not hidden behind compute, or
    time the peer was late to post). Traced rings record ``(hop index, start, end)`` of the wait, so
    the peers' post times can later tell the two apart (``bench.context.exposed_transfer``)."""
    t0 = time.perf_counter()
    for w in works:
        w.wait()
    t1 = time.perf_counter()
    if getattr(works, "events", None) is not None:
        works.events["waits"].append((works.index, t0, t1))
    return t1 - t0


def _add(timings: dict | None, **seconds: float) -> None:
    if timings is not None:
        for key, s in seconds.items():
            timings[key] = timings.get(key, 0.0) + s


class _RingAttention(torch.autograd.Function):
    """Ring attention forward/backward (module doc); inputs q (B,H,T,D), k/v (B,H_kv,T,D)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, timings, doc, drop):
        with torch.autocast(q.device.type, enabled=False):  # block math in the compute dtype, not autocast's
            return _RingAttention._forward(ctx, q, k, v, group, layout, timings, doc, drop)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, q, k, v, group, layout, timings, doc, drop):
        ring = _Ring(group, layout, q.size(2), doc, drop, q.device)
        if timings is not None:  # per-hop post and wait times, forward and backward (timings["events"])
            ring.events = timings.setdefault("events", {"posts": [], "waits": []})
        B, H, Hkv = q.size(0), q.size(1), k.size(1)
        p = drop.p if drop is not None else 0.0
        D = q.size(-1)
        cdt = torch.promote_types(q.dtype, torch.float32)  # compute dtype: fp32 for bf16/fp16
        scale = 1.0 / math.sqrt(D)
        qc = q.to(cdt)
        my_ids = ring.ids(ring.rank)
        outs: list = [None] * len(my_ids)
        lses: list = [None] * len(my_ids)
        kv = torch.stack((k, v)).contiguous()  # (2, B, H_kv, T, D): one message per hop
        spent = waited = 0.0
        for step in range(ring.size):
            works = []
            if step < ring.size - 1:  # post the next block's transfer before computing with this one
                nxt, works = ring.shift(kv, "cp_kv")
            t0 = time.perf_counter()
            kc, vc = kv[0].to(cdt), kv[1].to(cdt)
            for a, b, diag, allowed, keep in ring.blocks(step, B, H, Hkv):
                bout, blse = _block_forward(qc[..., ring.slot(a), :], kc[..., ring.slot(b), :],
                                            vc[..., ring.slot(b), :], diag, scale, allowed, keep, p)
                outs[a], lses[a] = merge(outs[a], lses[a], bout, blse)
            spent += time.perf_counter() - t0
            if works:
                waited += _wait(works)
                kv = nxt
        out = torch.cat(outs, dim=-2)  # (B, H, T, D)
        lse = torch.cat(lses, dim=-1)  # (B, H, T)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.timings = ring, timings
        _add(timings, forward_compute_s=spent, forward_wait_s=waited)
        return out.to(q.dtype)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        B, H, T, D = q.shape
        Hkv = k.size(1)
        cdt = out.dtype
        scale = 1.0 / math.sqrt(D)
        p = ring.drop.p if ring.drop is not None else 0.0
        qc, dc = q.to(cdt), dout.to(cdt)
        delta = (dc * out).sum(-1)  # (B, H, T): rowsum(dO * O) (FlashAttention backward)
        dq = torch.zeros_like(qc)
        kv = torch.stack((k, v)).contiguous()
        dkv = None  # the accumulators (2, B, H_kv, T, D) of the K/V block in hand, arriving from prev
        dkv_works: list = []
        spent = waited = 0.0
        for step in range(ring.size):
            kv_works = []
            if step < ring.size - 1:
                nxt, kv_works = ring.shift(kv, "cp_kv")
            t0 = time.perf_counter()
            kc, vc = kv[0].to(cdt), kv[1].to(cdt)
            local = torch.zeros((2, B, Hkv, T, D), dtype=cdt, device=q.device)  # this rank's part for this block
            for a, b, diag, allowed, keep in ring.blocks(step, B, H, Hkv):
                sa, sb = ring.slot(a), ring.slot(b)
                dqa, dkb, dvb = _block_backward(dc[..., sa, :], qc[..., sa, :], kc[..., sb, :], vc[..., sb, :],
                                                out[..., sa, :], lse[..., sa], delta[..., sa], diag, scale, allowed,
                                                keep, p)
                dq[..., sa, :] += dqa
                local[0][..., sb, :] += dkb
                local[1][..., sb, :] += dvb
            spent += time.perf_counter() - t0
            if dkv_works:  # the accumulators of this block, sent by the previous rank last step
                waited += _wait(dkv_works)
                local += dkv
            if ring.size > 1:  # the accumulators follow their K/V to the next rank
                dkv, dkv_works = ring.shift(local, "cp_dkv")
            else:
                dkv = local
            if kv_works:
                waited += _wait(kv_works)
                kv = nxt
        waited += _wait(dkv_works)  # after cp hops the accumulators of this rank's own K/V are home
        _add(ctx.timings, backward_compute_s=spent, backward_wait_s=waited)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str = "zigzag",
                   timings: dict | None = None, doc: torch.Tensor | None = None,
                   drop: AttnDropout | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries over the whole sequence by ring attention (module
    doc): q (B, H, T_local, D), k and v (B, H_kv, T_local, D) with H a multiple of H_kv, fp32, bf16
    or fp64 -> (B, H, T_local, D) in q's dtype, row for row equal to causal scaled dot-product
    attention (scale 1/sqrt(D)) over the full sequence of T = cp * T_local tokens.

    ``group``: the cp group (a ``comm.NamedGroup`` or a ProcessGroup; traffic is counted as
    ``send``/``recv`` with tags ``cp_kv`` (K and V, forward and backward: (cp-1) hops of
    2 * B * H_kv * T_local * D elements each) and ``cp_dkv`` (the dK/dV accumulators in the
    backward: cp hops, in the compute dtype: fp32 for bf16 inputs)). ``layout``: how the sequence
    is split, ``"zigzag"`` (:mod:`.split`, the default and the contract's) or ``"contiguous"`` (rank
    r holds tokens r*T_local .. (r+1)*T_local-1; for measuring the load balance). ``timings``: a
    dict to which ``forward_compute_s`` and ``backward_compute_s`` (seconds of block compute on
    this rank, waits excluded) and ``forward_wait_s`` and ``backward_wait_s`` (seconds waiting for
    transfers: the part not hidden behind compute) are added; host wall clock, exact on CPU (on
    CUDA the kernels are asynchronous and these are launch times). It also receives ``events``:
    ``{"posts": [time each hop was posted], "waits": [(hop index, wait start, wait end)]}`` in this
    rank's order (``time.perf_counter``, one clock for the processes of a host), from which
    ``zerotron.bench.context.exposed_transfer`` separates a peer's late post from transfer time.

    ``doc``: None, or the document indices (B, T) of the whole sequence in natural order
    (``.docmask``): each (query chunk, key chunk) block is then masked to same-document pairs (its
    mask built from the chunks' global positions, nothing extra travels) and a block with no
    allowed pair is skipped.

    ``drop``: None, or the attention dropout of this call (``models.attn_dropout.AttnDropout``: p,
    the key shared by the cp group, the first batch row and head): every block's probabilities are
    dropped with the coordinate-function mask of its global (row, head, query position, key
    position), in the forward and again in the backward, so the result equals one process's
    ``coordinate_attention`` with the same key. Dropout blocks run plain torch (the fused CPU kernel
    takes no external mask).

    Differentiable in q, k and v. Raises ValueError for an unknown layout or an odd zigzag T_local."""
    if q.size(1) % k.size(1) or k.shape != v.shape or q.size(2) != k.size(2):
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
                         "(B, H, T, D) / (B, H_kv, T, D) with H a multiple of H_kv")
    return _RingAttention.apply(q, k, v, group, layout, timings, doc, drop)
