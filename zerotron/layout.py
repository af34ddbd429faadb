"""Layer-split arithmetic of a pipeline layout: how ``n_layer`` blocks are divided over the pp*v
model stages. Pure Python (no torch), so ``config`` can check a split without importing
``parallel``; ``zerotron.parallel.pipeline.executor`` re-exports both functions."""
from __future__ import annotations

__all__ = ["stage_layer_counts", "stage_layer_ranges"]


def stage_layer_counts(n_layer: int, n_stages: int, pp_split: str = "") -> list[int]:
    """Layers per model stage: ``pp_split`` ("3,5": comma-separated counts, one per model stage =
    pp*v) or balanced, the first ``n_layer % n_stages`` stages taking one extra layer.
    Raises ValueError if pp_split is malformed, has the wrong length, a count < 1, or does not sum
    to n_layer; or (balanced) if n_layer < n_stages."""
    if pp_split.strip():
        try:
            counts = [int(c) for c in pp_split.split(",")]
        except ValueError:
            raise ValueError(f"parallel.pp_split must be comma-separated ints, got {pp_split!r}") from None
        if len(counts) != n_stages or min(counts) < 1 or sum(counts) != n_layer:
            raise ValueError(f"parallel.pp_split {pp_split!r} must list {n_stages} layer counts "
                             f"(pp * virtual_stages), each >= 1, summing to n_layer = {n_layer}")
        return counts
    if n_layer < n_stages:
        raise ValueError(f"n_layer = {n_layer} < {n_stages} model stages (pp * virtual_stages): "
                         "every stage needs at least one layer; lower pp/virtual_stages")
    base, extra = divmod(n_layer, n_stages)
    return [base + (s < extra) for s in range(n_stages)]


def stage_layer_ranges(counts: list[int]) -> list[range]:
    """Global layer-index range of each model stage from per-stage counts."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out
