"""Balanced pipeline stages (``parallel.pp_split = "auto"``): per-layer cost estimates from FLOPs.

Costs are read from the model itself -- its :class:`~zerotron.models.layout.ModelLayout` and the
shapes of its parameters -- so every model family gets them without naming one. Unit: forward
FLOPs per token (training costs about 3x that for every part alike, PaLM appendix B; only ratios
matter for the split):

* a block: 2 FLOPs per weight of its matrices (every parameter with >= 2 dims; a tensor-parallel
  shard counted at its dense size, so the split does not depend on tp) plus 4*T*C for the
  attention scores and values (QK^T and AV over T = ``config.block_size`` positions of width C =
  ``layout.width``; Chowdhery et al. 2022, "PaLM", appendix B, counts 12*L*C*T for forward +
  backward). With activation recomputation ``full`` a block's forward runs twice (x 4/3 of
  forward + backward); ``selective`` recomputes the attention term (its 4*T*C part x 4/3).
* the embedding (model stage 0): the lookup and the position add, 2*C per token (memory work, no
  matmul).
* the head (last model stage): the output projection 2*C*V (V = ``layout.vocab_size``, the real
  vocabulary; a tied head costs the same) plus the softmax cross-entropy, about 5*V per token
  (max, subtract, exp, sum, log per logit; an estimate, not a paper's count).

For the default model (C = 128, V = 4096, T = 128) the head costs 2.3 blocks, so two stages of 4
layers split "3,1", not "2,2". The split itself is :func:`zerotron.stages.balanced_counts` (min-max
contiguous partition, the equal split kept when it is already optimal).
"""
from __future__ import annotations

from zerotron.models.layout import get_module
from zerotron.parallel.tensor.layers import is_tp_sharded
from zerotron.stages import Placement, stage_costs, stage_layer_counts

__all__ = ["layer_costs", "resolve_split", "split_message", "announce_split"]

_ANNOUNCED: set = set()


def _dense_numel(p, tp: int) -> int:
    return p.numel() * (tp if is_tp_sharded(p) else 1)


def layer_costs(model, recompute: str = "none") -> tuple[list[float], float, float]:
    """``(block_costs, embedding_cost, head_cost)`` of ``model`` (a ``CausalLM`` or its tensor-
    parallel version; anything with ``layout()`` and ``config.block_size``), in forward FLOPs per
    token, as the module docstring derives them. ``recompute``: ``train.activation_checkpointing``
    (none | selective | full). Raises ValueError for another recompute value."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    lay = model.layout()
    tp_group = getattr(model, "tp_group", None)
    tp = tp_group.size() if tp_group is not None else 1
    c, v, t = lay.width, lay.vocab_size, model.config.block_size
    attn = 4.0 * t * c * (4 / 3 if recompute == "selective" else 1.0)
    blocks = []
    for block in get_module(model, lay.blocks):
        matmul = 2.0 * sum(_dense_numel(p, tp) for p in block.parameters() if p.dim() >= 2)
        blocks.append((matmul + attn) * (4 / 3 if recompute == "full" else 1.0))
    return blocks, 2.0 * c, 2.0 * c * v + 5.0 * v


def resolve_split(model, n_stages: int, pp_split: str, recompute: str = "none",
                  placement: Placement | None = None) -> list[int]:
    """Layers per model stage for ``parallel.pp_split`` (``"auto"``: balanced over
    :func:`layer_costs`, per rank's pair of stages under a V ``placement`` (zb-v);
    ``"even"``/``""``; or counts ``"3,5"``): see :func:`zerotron.stages.stage_layer_counts`, whose
    ValueErrors it raises."""
    n_layer = len(get_module(model, model.layout().blocks))
    costs = layer_costs(model, recompute) if pp_split.strip() == "auto" else None
    return stage_layer_counts(n_layer, n_stages, pp_split, costs, placement)


def split_message(model, counts: list[int], pp_split: str, recompute: str = "none",
                  placement: Placement | None = None) -> str:
    """One log line naming the split and the estimated cost of each model stage (relative to the
    largest), e.g. for the default model ``pipeline split (parallel.pp_split = auto): layers per
    stage 3,1; estimated stage costs (FLOPs) 0.90, 1.00 (the even split 2,2: 0.60, 1.30, a 1.30x
    slower bottleneck)``."""
    blocks, first, last = layer_costs(model, recompute)
    cost = stage_costs(counts, blocks, first, last)
    top = max(cost)
    msg = (f"pipeline split (parallel.pp_split = {pp_split or 'even'}): layers per stage "
           f"{','.join(map(str, counts))}; estimated stage costs (FLOPs) " + ", ".join(f"{x / top:.2f}" for x in cost))
    if placement is not None and placement.v > 1:  # several stages per rank: what each rank runs
        msg += (f"; per rank ({placement.shape} placement) "
                + ", ".join(f"{x / top:.2f}" for x in placement.rank_costs(cost)))
    even = stage_layer_counts(len(blocks), len(counts), "even")
    if even != counts:
        ec = stage_costs(even, blocks, first, last)
        msg += (f" (the even split {','.join(map(str, even))}: " + ", ".join(f"{x / top:.2f}" for x in ec)
                + f", a {max(ec) / top:.2f}x slower bottleneck)")
    return msg


def announce_split(model, counts: list[int], pp_split: str, recompute: str = "none",
                   placement: Placement | None = None) -> None:
    """Print :func:`split_message` once per process and distinct split (call it on rank 0 only)."""
    key = (tuple(counts), pp_split, recompute, len(counts), placement)
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        print("zerotron: " + split_message(model, counts, pp_split, recompute, placement), flush=True)

