"""Model stages of a pipeline layout: which rank holds which stage (:class:`Placement`) and how
``n_layer`` blocks are divided over the pp*v model stages (the layer split). Pure Python (no torch),
so the plan can check a split without importing ``parallel``; ``zerotron.parallel.pipeline.executor``
re-exports the split functions. (This module was ``zerotron.layout``; renamed so that it does not
share a name with ``zerotron.models.layout``, a model's parallel description.)

``parallel.pp_split`` values: ``"auto"`` (the default: :func:`balanced_counts` over per-layer cost
estimates, see ``zerotron.parallel.pipeline.balance``), ``"even"`` (equal layer counts; ``""`` is
the same, the value before "auto" existed) or explicit counts ``"3,5"``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

__all__ = ["Placement", "stage_layer_counts", "stage_layer_ranges", "balanced_counts", "even_counts", "stage_costs",
           "SPLIT_WORDS"]

SPLIT_WORDS = ("auto", "even", "")  # the non-numeric values of parallel.pp_split
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Placement:
    """Which pipeline rank holds which model stage: ``pp`` ranks, ``v`` model stages (chunks) per
    rank, ``pp * v`` model stages in all, in one of two shapes:

    * ``"loop"``: chunk c of rank r is stage ``c*pp + r`` (Megatron-LM's interleaving, Narayanan et
      al. 2021; with v = 1 simply stage r);
    * ``"v"``: ZB-V's V (Qi et al. 2024, sec. 6), v = 2: rank r holds stages r and 2pp-1-r, so rank 0
      has the first and the last stage and the turn from stage pp-1 to pp stays on rank pp-1.

    Built once by the plan (``ParallelPlan.placement``) and carried by a schedule
    (``schedules.Schedule.placement``). Raises ValueError for pp or v < 1, an unknown shape, or a V
    with v != 2."""

    pp: int
    v: int = 1
    shape: str = "loop"

    def __post_init__(self):
        if self.pp < 1 or self.v < 1:
            raise ValueError(f"a placement needs pp >= 1 and v >= 1, got pp={self.pp}, v={self.v}")
        if self.shape not in PLACEMENTS:
            raise ValueError(f"placement shape must be one of {PLACEMENTS}, got {self.shape!r}")
        if self.shape == "v" and self.v != 2:
            raise ValueError(f"the V placement (zb-v) holds two model stages per rank: virtual_stages must be 2, "
                             f"got {self.v}")

    @classmethod
    def for_schedule(cls, pp: int, kind: str, virtual_stages: int = 1) -> "Placement":
        """The placement a schedule ``kind`` runs on: the V for "zb-v", the loop otherwise."""
        return cls(pp, virtual_stages, "v" if kind == "zb-v" else "loop")

    @property
    def n_stages(self) -> int:
        """Model stages in all: pp * v."""
        return self.pp * self.v

    def stage_of(self, rank: int, chunk: int) -> int:
        """Model stage of local ``chunk`` (0 <= chunk < v) on pipeline ``rank``."""
        if self.shape == "v" and chunk == 1:
            return 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def rank_of(self, stage: int) -> int:
        """Pipeline rank holding model ``stage`` (the inverse of :meth:`stage_of`)."""
        if self.shape == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages(self, rank: int) -> list[int]:
        """The model stages of ``rank``, by chunk."""
        return [self.stage_of(rank, c) for c in range(self.v)]

    @property
    def last_rank(self) -> int:
        """Pipeline rank of the last model stage (the head and the loss)."""
        return self.rank_of(self.n_stages - 1)

    def rank_costs(self, stage_cost: list[float]) -> list[float]:
        """Per-rank sum of ``stage_cost`` (one number per model stage, any unit)."""
        if len(stage_cost) != self.n_stages:
            raise ValueError(f"{len(stage_cost)} stage costs for {self.n_stages} model stages")
        out = [0.0] * self.pp
        for s, c in enumerate(stage_cost):
            out[self.rank_of(s)] += c
        return out


def even_counts(n_layer: int, n_stages: int) -> list[int]:
    """Equal layer counts, the first ``n_layer % n_stages`` stages taking one extra layer. Raises
    ValueError if n_layer < n_stages."""
    if n_layer < n_stages:
        raise ValueError(f"n_layer = {n_layer} < {n_stages} model stages (pp * virtual_stages): "
                         "every stage needs at least one layer; lower pp/virtual_stages")
    base, extra = divmod(n_layer, n_stages)
    return [base + (s < extra) for s in range(n_stages)]


def stage_costs(counts: list[int], block_costs: list[float], first: float = 0.0, last: float = 0.0) -> list[float]:
    """Cost of each model stage of the split ``counts``: the sum of its blocks' ``block_costs``, plus
    ``first`` (embedding) on stage 0 and ``last`` (head + loss) on the last stage. Same unit as the
    inputs."""
    out, start = [], 0
    for c in counts:
        out.append(float(sum(block_costs[start:start + c])))
        start += c
    out[0] += first
    out[-1] += last
    return out


def balanced_counts(block_costs: list[float], n_stages: int, first: float = 0.0, last: float = 0.0,
                    rtol: float = 1e-9) -> list[int]:
    """Layers per model stage minimising the largest stage cost (:func:`stage_costs`): the
    min-max contiguous partition of the blocks (the "linear partition" problem; torchgpipe's
    ``balance_by_time``/``balance_by_size``, Kim et al. 2020, solve the same one), each stage at
    least one block, ``first`` added to stage 0 and ``last`` to the last stage.

    Exact dynamic programme, O(n_stages * n_layer^2). Ties: the equal-count split of
    :func:`even_counts` is kept whenever it reaches the optimum (within ``rtol``), so "auto" changes
    a split only when that lowers the bottleneck; otherwise, among the optimal splits, the one with
    the least sum of squared stage costs (then: earlier stages take more layers). Raises ValueError if there are fewer blocks than stages or a cost < 0."""
    n = len(block_costs)
    even = even_counts(n, n_stages)
    if min(block_costs, default=0.0) < 0 or first < 0 or last < 0:
        raise ValueError(f"stage costs must be >= 0, got blocks {block_costs}, first {first}, last {last}")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # tail[k][j]: least bottleneck of blocks j..n-1 over the last k stages (the last one adds `last`)
    tail = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    for j in range(n):
        tail[1][j] = prefix[n] - prefix[j] + last
    for k in range(2, n_stages + 1):
        for j in range(n - k + 1):
            tail[k][j] = min(max(prefix[e] - prefix[j], tail[k - 1][e]) for e in range(j + 1, n - k + 2))
    if n_stages == 1:
        return even
    best = min(max(prefix[e] + first, tail[n_stages - 1][e]) for e in range(1, n - n_stages + 2))
    bound = best * (1 + rtol) + 1e-300
    if max(stage_costs(even, block_costs, first, last)) <= bound:
        return even
    # among the optimal splits, the one with the least sum of squared stage costs (the most even
    # one: a pipeline's bubble depends on every stage, not only the slowest)
    def cost(j, e):
        return prefix[e] - prefix[j] + (first if j == 0 else 0.0) + (last if e == n else 0.0)

    sq = [[inf] * (n + 1) for _ in range(n_stages + 1)]  # sq[k][j]: blocks j.. over k stages
    sq[0][n] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(n - k + 1):
            sq[k][j] = min((cost(j, e) ** 2 + sq[k - 1][e] for e in range(j + 1, n - k + 2)
                            if cost(j, e) <= bound), default=inf)
    counts, j = [], 0
    for k in range(n_stages, 0, -1):
        e = min((e for e in range(j + 1, n - k + 2) if cost(j, e) <= bound),
                key=lambda e: (cost(j, e) ** 2 + sq[k - 1][e], -e))
        counts.append(e - j)
        j = e
    return counts


def v_rank_costs(stage_cost: list[float]) -> list[float]:
    """Per-rank cost under ZB-V's V placement: rank r runs model stages r and 2p-1-r
    (:meth:`Placement.rank_costs` of the V). Raises ValueError for an odd number of stages."""
    if len(stage_cost) % 2:
        raise ValueError(f"the V placement needs an even number of model stages, got {len(stage_cost)}")
    return Placement(len(stage_cost) // 2, 2, "v").rank_costs(stage_cost)


V_SEARCH_LIMIT = 200_000  # splits balanced_counts_v enumerates; above it the stage-balanced split


def balanced_counts_v(block_costs: list[float], n_stages: int, first: float = 0.0, last: float = 0.0,
                      rtol: float = 1e-9) -> list[int]:
    """Layers per model stage for ZB-V (``n_stages`` = 2p, rank r running stages r and 2p-1-r),
    minimising the largest *rank* cost (:func:`v_rank_costs` of :func:`stage_costs`), each stage at
    least one block; ties: :func:`balanced_counts`' stage-balanced split if it reaches the optimum
    (within ``rtol``), else the least sum of squared rank costs, then the lexicographically first.
    Exhaustive over the C(n-1, 2p-1) contiguous splits when there are at most V_SEARCH_LIMIT of
    them; beyond that it returns the stage-balanced split (a bound on the rank costs, not their
    optimum). Raises ValueError for an odd ``n_stages``, fewer blocks than stages or a cost < 0."""
    n = len(block_costs)
    stage_split = balanced_counts(block_costs, n_stages, first, last, rtol)  # also checks the inputs
    if n_stages % 2:
        raise ValueError(f"the V placement needs an even number of model stages, got {n_stages}")
    if math.comb(n - 1, n_stages - 1) > V_SEARCH_LIMIT:
        return stage_split
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def ranks(cuts):
        edges = (0, *cuts, n)
        st = [prefix[edges[i + 1]] - prefix[edges[i]] for i in range(n_stages)]
        st[0] += first
        st[-1] += last
        return v_rank_costs(st)

    best, best_key = None, None
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        rc = ranks(cuts)
        key = (max(rc), sum(x * x for x in rc))
        if best_key is None or key < best_key:
            best, best_key = cuts, key
    ref = v_rank_costs(stage_costs(stage_split, block_costs, first, last))
    if max(ref) <= best_key[0] * (1 + rtol) + 1e-300:
        return stage_split
    edges = (0, *best, n)
    return [edges[i + 1] - edges[i] for i in range(n_stages)]


def stage_layer_counts(n_layer: int, n_stages: int, pp_split: str = "", costs=None,
                       placement: Placement | None = None) -> list[int]:
    """Layers per model stage (one per model stage = pp*v) for ``pp_split``:

    * ``"3,5"``: those comma-separated counts;
    * ``"even"`` or ``""``: equal counts, the first ``n_layer % n_stages`` stages one extra layer;
    * ``"auto"``: :func:`balanced_counts` of ``costs`` = ``(block_costs, first, last)``
      (per-block, embedding and head costs, any one unit; see
      ``zerotron.parallel.pipeline.balance.layer_costs``); for a V ``placement`` (zb-v)
      :func:`balanced_counts_v`, which balances each rank's two stages together.

    Raises ValueError if pp_split is malformed, has the wrong length, a count < 1, or does not sum
    to n_layer; if n_layer < n_stages; for "auto" without ``costs`` or with len(block_costs) !=
    n_layer."""
    word = pp_split.strip()
    if word == "auto":
        if costs is None:
            raise ValueError("parallel.pp_split = auto needs per-layer cost estimates (costs=...)")
        blocks, first, last = costs
        if len(blocks) != n_layer:
            raise ValueError(f"{len(blocks)} block costs for n_layer = {n_layer}")
        even_counts(n_layer, n_stages)  # the same error for too few layers
        v_shaped = placement is not None and placement.shape == "v"
        return (balanced_counts_v if v_shaped else balanced_counts)(list(blocks), n_stages, first, last)
    if word and word != "even":
        try:
            counts = [int(c) for c in pp_split.split(",")]
        except ValueError:
            raise ValueError(f"parallel.pp_split must be auto, even or comma-separated ints, got {pp_split!r}") from None
        if len(counts) != n_stages or min(counts) < 1 or sum(counts) != n_layer:
            raise ValueError(f"parallel.pp_split {pp_split!r} must list {n_stages} layer counts "
                             f"(pp * virtual_stages), each >= 1, summing to n_layer = {n_layer}")
        return counts
    return even_counts(n_layer, n_stages)


def stage_layer_ranges(counts: list[int]) -> list[range]:
    """Global layer-index range of each model stage from per-stage counts."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out
