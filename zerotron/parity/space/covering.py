"""The pairwise covering arrays of the parity matrix: a greedy choice of layouts in which every pair
of factor values that occurs in some valid layout occurs at least once, per model family
(:func:`covering_layouts`) or over every family at once (:func:`joint_covering`)."""
from __future__ import annotations

import itertools

from .layout import FACTORS, MODELS, Layout
from .witnesses import MUST, witness_families


def _greedy_cover(rows: list[list], costs: list[int], n_fixed: int) -> list[int]:
    """The greedy pairwise covering array over ``rows`` (each a list of (factor, value) assignments,
    in one factor order): the indices of the first ``n_fixed`` rows (the witnesses), then in each
    round the row that covers the most pairs still missing, ties to the lower ``costs`` (processes,
    < 16), then to the lower index, until every pair that occurs in some row occurs in a chosen one.
    Each row's pairs are one row of column ids; its count of missing pairs is kept in one array and
    lowered as pairs get covered (the same choice as recounting every row's pairs each round)."""
    import numpy as np

    ids: dict = {}  # (assignment, assignment) pair -> column
    cols = np.array([[ids.setdefault(p, len(ids)) for p in itertools.combinations(r, 2)] for r in rows],
                    dtype=np.int64).reshape(len(rows), -1)
    todo = np.ones(len(ids), dtype=bool)
    todo[cols[:n_fixed].ravel()] = False  # the pairs the witnesses cover
    # rank of each row: 16 x missing pairs it holds - its cost (costs < 16)
    score = todo[cols].sum(axis=1) * 16 - np.asarray(costs, dtype=np.int64)
    score[:n_fixed] = low = np.iinfo(np.int64).min
    chosen = list(range(n_fixed))
    while todo.any():
        b = int(np.argmax(score))  # the first maximum in row order: the tie rule
        chosen.append(b)
        covered = np.zeros(len(ids), dtype=bool)
        covered[cols[b][todo[cols[b]]]] = True
        todo &= ~covered
        score -= covered[cols].sum(axis=1) * 16
        score[b] = low
    return chosen


def _assignments(lay: Layout, keys: list) -> list:
    return [(k, getattr(lay, k)) for k in keys]


def covering_layouts(layouts: list[Layout], must: tuple = MUST, extra_keys: tuple = ()) -> list[Layout]:
    """A greedy pairwise covering array (:func:`_greedy_cover`): a subset of ``layouts`` in which
    every pair of (factor, value) assignments that occurs in ``layouts`` occurs at least once, plus
    the ``must`` witnesses (:data:`MUST`); ``extra_keys``: Layout fields that count as factors too
    (the MoE family's "ep"). Ties go to fewer processes, then to the name, so the choice is
    deterministic. Returns the layouts sorted by (world, name)."""
    keys = list(FACTORS) + list(extra_keys)
    fixed = [l for l in layouts if l.name in must]
    rest = sorted((l for l in layouts if l.name not in must), key=lambda l: (l.world, l.name))
    cand = fixed + rest
    pick = _greedy_cover([_assignments(l, keys) for l in cand], [l.world for l in cand], len(fixed))
    return sorted((cand[i] for i in pick), key=lambda l: (l.world, l.name))


def joint_covering(layouts: list[Layout], families: tuple = tuple(MODELS), must: tuple = MUST,
                   witness=witness_families) -> list[tuple[str, Layout]]:
    """One pairwise covering array over every model family at once, the family as one more factor:
    ``(family, layout)`` pairs in which every pair of (factor, value) assignments that occurs in
    ``families x layouts`` occurs at least once -- (family, value) pairs included, so each family
    sees every value of every factor -- plus the witnesses ``must`` (:data:`MUST`), each in the
    families ``witness(layout)`` names (:func:`witness_families`). Roughly half the layouts of one
    covering array per family.
    Ties go to fewer processes, then to the name, then to the family order. Returns the pairs sorted
    by (world, name, family)."""
    keys = list(FACTORS)
    order = {f: i for i, f in enumerate(families)}
    fams = {l.name: [f for f in witness(l) if f in order] for l in layouts if l.name in must}
    fixed = [(f, l) for l in layouts for f in fams.get(l.name, ())]
    rest = sorted(((f, l) for l in layouts for f in families if f not in fams.get(l.name, ())),
                  key=lambda x: (x[1].world, x[1].name, order[x[0]]))
    cand = fixed + rest
    pick = _greedy_cover([[("family", f)] + _assignments(l, keys) for f, l in cand], [l.world for _, l in cand],
                         len(fixed))
    return sorted((cand[i] for i in pick), key=lambda x: (x[1].world, x[1].name, order[x[0]]))
