"""Attention-probability dropout whose mask is a pure function of global coordinates.

torch's fused attention draws its dropout mask from the RNG stream of the process that runs it, so a
mask depends on how the work is split: under context parallelism (``zerotron.parallel.context``) no
rank computes the whole (query, key) matrix of a head, the ring computes it block by block (and again
in the backward), the all-to-all implementation over a slice of the heads. Here the decision "keep
score (b, h, i, j)" is a counter-based hash (in the spirit of Salmon et al. 2011, "Parallel random
numbers: as easy as 1, 2, 3": a random number is a function of a key and a counter, not of a
sequential state) of

    (key, global batch row b, global head h, global query position i, global key position j)

computed with torch int64 ops over whatever block is in hand. Any implementation, any split and any
recomputation that uses the same ``key`` applies exactly the mask one process applies, so dropout
under cp is tested exactly (fp64) against one process running :func:`coordinate_attention`.

The hash: 32-bit values held in int64 (every product of a value < 2**32 and the odd constant
< 2**28 stays below 2**63, so no signed overflow), each coordinate folded in with an xor followed by
an xor-shift-multiply finaliser (the construction of MurmurHash3's ``fmix32``, with its own
constant); a score is kept when its 32-bit hash is >= round(p * 2**32), i.e. with probability 1 - p
up to 2**-32, and kept probabilities are scaled by 1 / (1 - p) (inverted dropout, Srivastava et al.
2014).

``key``: a 62-bit integer per attention call, :func:`draw_key` from the current torch RNG stream (one
draw, whatever the tensor sizes; the tensor-parallel ``dropout_rng`` stream when the attention
module runs inside it). Context parallelism broadcasts cp rank 0's key over the cp group
(``parallel.context.attention.shared_key``). Activation checkpointing restores the RNG state before
recomputing (``torch.utils.checkpoint``), so the recomputation draws the same key and regenerates
the same masks.

The switch: a single process (``cp = 1``) keeps torch's fused SDPA dropout (fast on GPU; its masks
are not coordinate functions). ``ZEROTRON_ATTN_DROPOUT=coordinate`` in the environment, or
``with coordinate_dropout():``, makes ``models.base.causal_attention`` and
``parallel.context.documents.doc_attention`` use the coordinate mask too (:func:`forced`), so the
one-process reference of an exactness test runs the same mask code path.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

__all__ = ["AttnDropout", "apply_keep", "coordinate_attention", "coordinate_dropout", "draw_key", "forced",
           "keep_mask"]

_M32 = 0xFFFFFFFF
_MUL = 0x0B5297A5  # odd, < 2**28: value * _MUL < 2**60 for 32-bit values
_FORCED: list[bool] = []


def _mix(h: torch.Tensor) -> torch.Tensor:
    """32-bit finaliser (xor-shift-multiply, twice) of int64 values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MUL) & _M32
    h = h ^ (h >> 15)
    h = (h * _MUL) & _M32
    return h ^ (h >> 16)


def _fold(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _mix(h ^ (x & _M32))


def _mix_(h: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` in place (the full-size (B, H, Tq, Tk) stage: no new tensor per op)."""
    h.bitwise_xor_(h >> 16).mul_(_MUL).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15).mul_(_MUL).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


@dataclass(frozen=True)
class AttnDropout:
    """One attention call's dropout: probability ``p`` in (0, 1), the 62-bit ``key``, and the global
    index of the first batch row (``row0``) and first query head (``head0``) of the tensors in hand
    (the all-to-all implementation adds its head slice's offset)."""

    p: float
    key: int
    row0: int = 0
    head0: int = 0

    def shifted(self, heads: int) -> AttnDropout:
        """The same dropout for tensors whose first head is ``heads`` further on."""
        return AttnDropout(self.p, self.key, self.row0, self.head0 + heads)

    def keep(self, B: int, H: int, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """:func:`keep_mask` of B rows and H heads from (row0, head0) at global positions qpos (Tq,),
        kpos (Tk,) int64 -> bool (B, H, Tq, Tk)."""
        dev = qpos.device
        rows = torch.arange(self.row0, self.row0 + B, device=dev)
        heads = torch.arange(self.head0, self.head0 + H, device=dev)
        return keep_mask(self.key, self.p, rows, heads, qpos, kpos)


def keep_mask(key: int, p: float, rows: torch.Tensor, heads: torch.Tensor, qpos: torch.Tensor,
              kpos: torch.Tensor) -> torch.Tensor:
    """Which attention probabilities survive dropout ``p``: bool (B, H, Tq, Tk), True = kept, for
    global batch rows ``rows`` (B,), heads ``heads`` (H,), query positions ``qpos`` (Tq,) and key
    positions ``kpos`` (Tk,) (int64, each < 2**32) under the 62-bit ``key`` (module doc). A pure
    function: equal coordinates give equal bits on any device split. Raises ValueError for p
    outside [0, 1)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention dropout p must be in [0, 1), got {p}")
    dev = rows.device
    h = _fold(_mix(torch.tensor(key & _M32, dtype=torch.int64, device=dev)), torch.tensor(key >> 32, device=dev))
    h = _fold(h, rows.long())[:, None, None, None]          # (B, 1, 1, 1)
    h = _fold(h, heads.long()[None, :, None, None])        # (B, H, 1, 1)
    h = _fold(h, qpos.long()[None, None, :, None])         # (B, H, Tq, 1)
    h = _mix_(h ^ (kpos.long() & _M32)[None, None, None, :])  # (B, H, Tq, Tk), in place
    return h >= int(round(p * 2 ** 32))


def apply_keep(probs: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout of probabilities ``probs`` with the boolean ``keep`` (broadcastable):
    probs * keep / (1 - p)."""
    return torch.where(keep, probs * (1.0 / (1.0 - p)), 0.0)


def coordinate_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                         drop: AttnDropout, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Masked scaled dot-product attention with coordinate dropout, in plain torch (differentiable by
    autograd): q (B, H, Tq, D), k/v (B, H_kv, Tk, D) (H a multiple of H_kv; query head h uses kv head
    h // (H/H_kv)), ``allowed`` bool broadcastable to (B, H, Tq, Tk) (every query row allows at
    least one key), ``qpos`` (Tq,) and ``kpos`` (Tk,) the global positions -> (B, H, Tq, D):
    softmax(q k^T / sqrt(D), masked) with :func:`keep_mask` dropout, times v. Computed in q's dtype
    (fp32 for bf16/fp16 inputs, cast back)."""
    out_dtype = q.dtype
    cdt = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    B, H = q.shape[:2]
    if k.size(1) != H:
        rep = H // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / q.size(-1) ** 0.5)
    probs = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = apply_keep(probs, drop.keep(B, H, qpos, kpos), drop.p)
    return torch.matmul(probs, v).to(out_dtype)


def draw_key() -> int:
    """A 62-bit key from the current torch RNG stream (one draw of the CPU default generator, or of
    the forked stream inside ``dropout_rng()``)."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


@contextlib.contextmanager
def coordinate_dropout(on: bool = True):
    """Within the block, single-process attention with dropout uses the coordinate mask (``on``) or
    torch's fused dropout (``not on``), whatever the environment says."""
    _FORCED.append(on)
    try:
        yield
    finally:
        _FORCED.pop()


def forced() -> bool:
    """Whether single-process attention dropout takes the coordinate mask: the innermost
    :func:`coordinate_dropout`, else ``ZEROTRON_ATTN_DROPOUT=coordinate`` in the environment."""
    if _FORCED:
        return _FORCED[-1]
    return os.environ.get("ZEROTRON_ATTN_DROPOUT", "").strip().lower() == "coordinate"
