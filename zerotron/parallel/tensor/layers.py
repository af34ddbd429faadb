"""Tensor (Megatron) and sequence parallelism: shard metadata and parallel layers. The raw
collectives and the f / g autograd operators are in ``tensor/ops.py``, the vocab-parallel
cross-entropy in ``tensor/loss.py`` (both re-exported here); the RNG tracker and the model transform in
``tensor/transform.py``.

Sources
  * Shoeybi et al. 2019, "Megatron-LM" (arXiv:1909.08053), sec. 3: the conjugate operators f
    (identity forward, all-reduce backward) and g (all-reduce forward, identity backward); a
    column-parallel linear (weight rows split, Y_t = X W_t^T) followed by a row-parallel one (input
    columns split, Y = sum_t X_t W_t^T); attention split by heads; the vocab-parallel input
    embedding and the parallel cross-entropy that reduces B*T scalars instead of gathering B*T*V logits.
  * Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), sec. 4.2.2: sequence parallelism. g becomes a reduce-scatter along the
    sequence (its conjugate: all-gather in backward) and f an all-gather along the sequence
    (reduce-scatter in backward); LayerNorm and dropout work on a 1/tp shard of the sequence.

Shapes: B batch, T sequence, C channels, V vocabulary; activations are (B, T, C), sequence dim 1.
Every collective goes through ``zerotron.distributed.comm`` on ``tp_group`` with ``tag`` in forward
and ``tag + "_bwd"`` in backward. With a group of size 1 every operator is the identity (no call).
Parameter metadata (set by :func:`mark_sharded`): one typed record :class:`TPShard` in
``param.tp_shard`` (absent on tp-replicated parameters); :func:`full_tensor` and
:func:`shard_tensor` convert between dense and local.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotron.distributed import comm
from zerotron.parallel.tensor.loss import vocab_parallel_cross_entropy
from zerotron.parallel.tensor.ops import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp",
           "gather_from_tp", "scatter_to_tp", "vocab_parallel_cross_entropy", "TPShard", "mark_sharded",
           "tp_shard_of", "is_tp_sharded",
           "shard_tensor", "local_shard", "full_tensor", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding"]


# names of the tp RNG tracker's states (``transform.RNGStatesTracker``): tp-sharded regions, replicated ones
MODEL_PARALLEL, REPLICATED = "model-parallel", "replicated"

# ----------------------------------------------------------------------------- shard metadata
@dataclass(frozen=True)
class TPShard:
    """How a parameter is a tensor-parallel slice of a dense tensor: along ``dim``, whose dense size
    is made of ``chunks`` equal stacked parts (3 for a fused [q|k|v]) each split over tp; the dense
    size along ``dim`` is ``full_size`` (None: the padded size; a padded vocabulary has
    full_size < padded size)."""

    dim: int
    chunks: int = 1
    full_size: int | None = None


def mark_sharded(p: nn.Parameter, dim: int, chunks: int = 1, full_size: int | None = None) -> nn.Parameter:
    """Record ``TPShard(dim, chunks, full_size)`` as ``p.tp_shard``. Returns ``p``."""
    p.tp_shard = TPShard(dim, chunks, full_size)
    return p


def tp_shard_of(p: torch.Tensor) -> TPShard | None:
    """``p``'s :class:`TPShard`, or None when it is replicated over tp."""
    return getattr(p, "tp_shard", None)


def is_tp_sharded(p: torch.Tensor) -> bool:
    """True if ``p`` is a tensor-parallel shard (count it on every tp rank in a norm); False if it
    is replicated over tp (count it once)."""
    return getattr(p, "tp_shard", None) is not None


def shard_tensor(full: torch.Tensor, dim: int, group, chunks: int = 1, padded_size: int | None = None):
    """This rank's slice of a dense tensor: zero-pad ``dim`` to ``padded_size``, cut it into
    ``chunks`` parts and take part ``rank`` of ``tp`` from each. Raises ValueError if a part's size
    is not divisible by tp."""
    n, r = group.size(), group.rank()
    if padded_size is not None and padded_size > full.size(dim):
        pad = list(full.shape)
        pad[dim] = padded_size - full.size(dim)
        full = torch.cat([full, full.new_zeros(pad)], dim)
    if full.size(dim) % (chunks * n):
        raise ValueError(f"cannot shard size {full.size(dim)} of dim {dim} into {chunks} part(s) x tp={n}")
    pieces = [c.chunk(n, dim)[r] for c in full.chunk(chunks, dim)]
    return torch.cat(pieces, dim).detach().clone().contiguous()


def local_shard(p: torch.Tensor, dense, group):
    """Inverse of :func:`full_tensor`: this rank's slice of ``dense`` laid out like the parameter
    ``p`` (its TPShard dim, chunks and padded size); ``dense`` is returned unchanged when ``p`` is
    replicated over tp or ``dense`` is not a tensor of dim >= 1 (e.g. Adam's step). No communication."""
    if not (is_tp_sharded(p) and isinstance(dense, torch.Tensor) and dense.dim() > 0):
        return dense
    m = p.tp_shard
    return shard_tensor(dense, m.dim, group, m.chunks, p.size(m.dim) * group.size())


def full_tensor(p: torch.Tensor, group, local: torch.Tensor | None = None, tag: str = "tp_export"):
    """Dense tensor of ``local`` (default ``p`` itself, e.g. pass ``p.grad``) laid out like the
    parameter ``p``: the inverse of :func:`shard_tensor` (all-gather, reorder chunks, drop padding).
    Replicated parameters are returned as they are (detached). Collective for sharded ones: every
    tp rank must call it, in the same order (tag ``tag``)."""
    local = (p if local is None else local).detach()
    if not is_tp_sharded(p) or group.size() == 1:
        full = local
    else:
        n, dim, chunks = group.size(), p.tp_shard.dim, p.tp_shard.chunks
        flat = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather(flat, local.contiguous(), group=group, tag=tag)
        parts = [x.chunk(chunks, dim) for x in flat.view(n, *local.shape).unbind(0)]
        full = torch.cat([parts[r][c] for c in range(chunks) for r in range(n)], dim)
    meta = tp_shard_of(p)
    if meta is not None and meta.full_size is not None:
        full = full.narrow(meta.dim, 0, meta.full_size)
    return full.contiguous()


# ----------------------------------------------------------------------------- layers
class _ParallelLinear(nn.Module):
    """What the column- and row-parallel layers share: sizes, the tp group, the comm tag, and the
    check that tp divides the split dimension (``split`` = "out_features" | "in_features"; raises
    ValueError naming it)."""

    def __init__(self, in_features: int, out_features: int, tp_group, split: str, sequence_parallel: bool):
        super().__init__()
        n = tp_group.size()
        size = in_features if split == "in_features" else out_features
        if size % n:
            raise ValueError(f"{type(self).__name__}: {split} {size} not divisible by tp={n}")
        self.in_features, self.out_features, self.tp_group = in_features, out_features, tp_group
        self.sequence_parallel, self.comm_tag = sequence_parallel, "tp"


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A's output rows split over tp (Shoeybi et al. 2019, sec. 3).

    Input (B, T, in) replicated (through f), or (B, T/tp, in) with ``sequence_parallel`` (all-gathered
    along T first, reduce-scattered in backward; Korthikanti et al. 2022). Output (B, T, out/tp), or
    (B, T, out) with ``gather_output``. weight (out/tp, in), bias (out/tp). Raises ValueError if
    tp does not divide ``out_features``. A fresh layer draws its shard N(0, 0.02) from the current
    RNG; use :meth:`from_dense` for weights equal to a dense layer."""

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, tp_group, "out_features", sequence_parallel)
        n, kw = tp_group.size(), dict(device=device, dtype=dtype)
        self.gather_output = gather_output
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features // n, in_features, **kw)), 0)
        nn.init.normal_(self.weight, std=0.02)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(out_features // n, **kw)), 0) if bias else None

    @classmethod
    def from_dense(cls, dense: nn.Linear, tp_group, gather_output: bool = False,
                   sequence_parallel: bool = False, chunks: int = 1,
                   padded_size: int | None = None) -> "ColumnParallelLinear":
        """This rank's rows of ``dense`` (out, in). ``chunks``: the output is ``chunks`` stacked equal
        parts split separately (3 for attention's [q|k|v], so rank t gets q_t, k_t, v_t).
        ``padded_size``: zero-pad the output to this many rows first (an untied vocabulary head
        padded like the vocab-parallel embedding; the dense size stays ``out_features``)."""
        w, out = dense.weight, dense.out_features
        size = padded_size if padded_size is not None else out
        m = cls(dense.in_features, size, tp_group, dense.bias is not None, gather_output,
                sequence_parallel, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            m.weight.copy_(shard_tensor(w, 0, tp_group, chunks, padded_size))
            if m.bias is not None:
                m.bias.copy_(shard_tensor(dense.bias, 0, tp_group, chunks, padded_size))
        full = out if size != out else None
        for p in m.parameters():
            mark_sharded(p, 0, chunks, full)
        return m

    @classmethod
    def tied(cls, weight: nn.Parameter, tp_group, sequence_parallel: bool = False) -> "ColumnParallelLinear":
        """A bias-free layer whose weight *is* ``weight`` (out/tp, in), e.g. the vocab-parallel
        embedding's (weight tying, Press & Wolf 2017)."""
        n = tp_group.size()
        m = cls(weight.size(1), n, tp_group, bias=False, sequence_parallel=sequence_parallel,
                device="meta", dtype=weight.dtype)
        m.out_features, m.weight = weight.size(0) * n, weight
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, tag = self.tp_group, self.comm_tag
        x = gather_from_sp(x, g, tag) if self.sequence_parallel else copy_to_tp(x, g, tag)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, g, tag) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_group.size()}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """Y = sum_t X_t A_t^T + b with A's input columns split over tp (Shoeybi et al. 2019, sec. 3).

    Input (B, T, in/tp) if ``input_is_parallel`` else (B, T, in) (sliced here). The partial sums are
    all-reduced (g) to (B, T, out), or reduce-scattered to (B, T/tp, out) with ``sequence_parallel``
    (Korthikanti et al. 2022); the bias (out, replicated) is added once, after the reduction.
    weight (out, in/tp). Raises ValueError if tp does not divide ``in_features`` or if
    sequence_parallel is asked without input_is_parallel."""

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, device=None, dtype=None):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        super().__init__(in_features, out_features, tp_group, "in_features", sequence_parallel)
        n, kw = tp_group.size(), dict(device=device, dtype=dtype)
        self.input_is_parallel = input_is_parallel
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, in_features // n, **kw)), 1)
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None

    @classmethod
    def from_dense(cls, dense: nn.Linear, tp_group, input_is_parallel: bool = True,
                   sequence_parallel: bool = False) -> "RowParallelLinear":
        """This rank's input columns of ``dense`` (out, in); the bias is copied whole."""
        w = dense.weight
        m = cls(dense.in_features, dense.out_features, tp_group, dense.bias is not None, input_is_parallel,
                sequence_parallel, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            m.weight.copy_(shard_tensor(w, 1, tp_group))
            if m.bias is not None:
                m.bias.copy_(dense.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, tag = self.tp_group, self.comm_tag
        if not self.input_is_parallel:
            x = scatter_to_tp(x, g, tag)
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y, g, tag) if self.sequence_parallel else reduce_from_tp(y, g, tag)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_group.size()}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp (Shoeybi et al. 2019, sec. 3).

    The vocabulary is zero-padded to V_pad = ceil(V/tp)*tp; rank t owns ids [vocab_start, vocab_end)
    = [t*V_pad/tp, (t+1)*V_pad/tp), weight (V_pad/tp, C). ids (B, T) outside the range look up row 0
    and are masked to 0, then the partial outputs are all-reduced -> (B, T, C), or reduce-scattered
    along the sequence -> (B, T/tp, C) with ``sequence_parallel`` (Korthikanti et al. 2022)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        n, r = tp_group.size(), tp_group.rank()
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.padded_num_embeddings = -(-num_embeddings // n) * n
        per = self.padded_num_embeddings // n
        self.vocab_start, self.vocab_end = r * per, (r + 1) * per
        self.sequence_parallel, self.comm_tag = sequence_parallel, "tp"
        w = torch.empty(per, embedding_dim, device=device, dtype=dtype)
        nn.init.normal_(w, std=0.02)
        w[max(0, min(per, num_embeddings - self.vocab_start)):] = 0  # padded rows
        self.weight = mark_sharded(nn.Parameter(w), 0, full_size=num_embeddings)

    @classmethod
    def from_dense(cls, dense: nn.Embedding, tp_group, sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        """This rank's rows of ``dense`` (V, C), padding rows zero."""
        w = dense.weight
        m = cls(dense.num_embeddings, dense.embedding_dim, tp_group, sequence_parallel, w.device, w.dtype)
        with torch.no_grad():
            m.weight.copy_(shard_tensor(w, 0, tp_group, padded_size=m.padded_num_embeddings))
        return m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        g, tag = self.tp_group, self.comm_tag
        return reduce_scatter_to_sp(y, g, tag) if self.sequence_parallel else reduce_from_tp(y, g, tag)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), {self.embedding_dim}, "
                f"rows [{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}")
