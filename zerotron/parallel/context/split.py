"""The load-balanced ("zigzag") split of a sequence over the cp ranks (pure index arithmetic).

Under a causal mask the work of a query grows with its position, so cutting the sequence into cp
contiguous pieces gives the last rank ~(2cp-1)x the attention work of the first. The zigzag split
cuts it into 2*cp equal chunks and gives cp rank r the chunks r and 2*cp-1-r (a head chunk and a
tail chunk), so every rank does the same work (as Megatron-LM's context parallelism and
ring-flash-attention's "zigzag" do; Llama 3, section 3.3.2, uses the same 2*cp chunks).

A rank's local sequence is its two chunks concatenated: local index j < T/(2cp) is global position
r*C + j, the rest (2cp-1-r)*C + (j - C), with C = T/(2cp).
"""
from __future__ import annotations

import torch

__all__ = ["check_split", "chunk_ids", "zigzag_positions", "split_sequence", "unsplit_order"]


def check_split(seq_len: int, cp: int) -> None:
    """Raise ValueError (one line naming the fix) unless 2*cp divides ``seq_len``."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"context parallel needs the sequence length ({seq_len}) divisible by 2*cp = {2 * cp} "
                         "(the zigzag split); change model.block_size or parallel.cp")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) that cp rank ``rank`` holds: (rank, 2*cp-1-rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside [0, {cp})")
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (T/cp,) int64 of cp rank ``rank``'s local tokens, in local order.
    Raises ValueError when 2*cp does not divide ``seq_len``."""
    check_split(seq_len, cp)
    c = seq_len // (2 * cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's local part of ``x`` along ``dim`` (the sequence axis, length T): size T/cp there."""
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_positions(x.size(dim), cp, rank, device=x.device))


def unsplit_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Permutation (T,) int64: concatenating every cp rank's local sequence in rank order and indexing
    the result with it gives the natural order 0..T-1 (what an all-gather over cp returns, reordered)."""
    check_split(seq_len, cp)
    gathered = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)])  # global position of each slot
    return torch.argsort(gathered).to(device) if device is not None else torch.argsort(gathered)
