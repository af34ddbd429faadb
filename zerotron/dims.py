"""The axes table of a layout: named parallel dimensions, their roles, and the groups built from them.

Pure Python (no torch), so the plan, the estimators and the CLI can reason about coordinates without
a process group. :class:`zerotron.distributed.mesh.Mesh` turns a :class:`ParallelDims` into one torch
``DeviceMesh`` over :data:`AXES` and flattens the :data:`COMBINED` groups out of it.

Axes, outermost to innermost (the last varies fastest over global ranks, so tensor-parallel peers are
neighbouring ranks on the fastest links, as in Megatron-LM and picotron; torchtitan's ``ParallelDims``
uses the same order):

    ====================  ==========  ================================================================
    axis                  role        meaning
    ====================  ==========  ================================================================
    ``pp``                model       pipeline stage (layers split over ranks)
    ``dp_replicate``      batch       HSDP replica (``parallel.dp_replicate``; 1 without HSDP)
    ``dp_shard``          batch       data-parallel rank inside a replica; ZeRO/FSDP shard over it
    ``cp``                sequence    context-parallel rank (two zigzag chunks of every sequence)
    ``tp``                model       tensor-parallel rank (a slice of every weight matrix)
    ====================  ==========  ================================================================

Global rank of coordinates c = mixed-radix number of (c[a] for a in AXES) with the degrees as radices:
``((((pp * R + r) * S + s) * CP + c) * TP + t)``. With ``cp = 1`` this is the earlier (pp, dp, tp)
numbering with ``dp = r * S + s``, so existing run directories and checkpoints keep their meaning.

Combined groups (the groups the engine talks in; :data:`COMBINED`):
  * ``dp``        = dp_replicate x dp_shard: the data-parallel group (gradient all-reduce of DDP);
  * ``batch``     = dp x cp: every rank that holds a different part of the same global batch; target
                    tokens are counted over it (world-size-invariant loss normalisation);
  * ``loss``      = pp x batch: where per-rank loss sums are added up (a pipeline's last stage has them);
  * ``shard``     = dp_shard x cp: what ZeRO / FSDP shard parameters, gradients and optimizer state over
                    (torchtitan's ``dp_shard_cp``);
  * ``replicate`` = dp_replicate: across which shards are all-reduced (HSDP).

Expert parallelism (``parallel.ep``) is not a factor of the world size but a split of the batch group
``dp x cp`` (``dp_shard x cp`` under HSDP), as in torchtitan: ``zerotron.parallel.expert``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError

__all__ = ["AXES", "ROLES", "COMBINED", "ParallelDims"]

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ROLES = {"pp": "model", "dp_replicate": "batch", "dp_shard": "batch", "cp": "sequence", "tp": "model"}
COMBINED = {"dp": ("dp_replicate", "dp_shard"), "batch": ("dp_replicate", "dp_shard", "cp"),
            "loss": ("pp", "dp_replicate", "dp_shard", "cp"), "shard": ("dp_shard", "cp"),
            "replicate": ("dp_replicate",)}
ALIASES = {"dp_rep": "dp_replicate"}  # the name the HSDP groups had before the axes table


def _need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the parallel axes of a run of ``world_size`` processes (see the module doc).

    Args (config names): ``dp`` (``parallel.dp``; 0 = derive world_size // (tp * pp * cp)),
    ``tp``, ``pp``, ``dp_replicate`` (HSDP replicas: ``dp = dp_replicate x dp_shard``), ``cp``.
    Raises ConfigError (one line naming the fix) when a degree is < 1, the product differs from the
    world size, or dp_replicate does not divide dp."""

    world_size: int
    dp: int = 0
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("world_size", "dp", "tp", "pp", "dp_replicate", "cp"):
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool),
                  f"parallel degree {name} must be an integer, got {value!r}")
        _need(self.world_size >= 1, f"the world size must be >= 1, got {self.world_size}")
        for name in ("tp", "pp", "cp"):
            _need(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _need(self.dp >= 0, f"parallel.dp must be >= 1 (or 0 = derive from world size), got {self.dp}")
        model = self.tp * self.pp * self.cp
        names = "tp*pp" + ("*cp" if self.cp > 1 else "")
        values = f"{self.tp}*{self.pp}" + (f"*{self.cp}" if self.cp > 1 else "")
        if self.dp == 0:
            _need(self.world_size % model == 0,
                  f"world size {self.world_size} is not divisible by {names} = {values}; "
                  "change --nproc or parallel.tp / parallel.pp" + (" / parallel.cp" if self.cp > 1 else ""))
            object.__setattr__(self, "dp", self.world_size // model)
        _need(self.dp * model == self.world_size,
              f"parallel.dp*{names} = {self.dp}*{values} = {self.dp * model} does not "
              f"equal the world size {self.world_size}; set parallel.dp = 0 to derive it or change --nproc")
        _need(self.dp_replicate >= 1 and self.dp % self.dp_replicate == 0,
              f"parallel.dp_replicate ({self.dp_replicate}) must be >= 1 and divide the dp degree ({self.dp}): "
              "dp = replicas x shards; change parallel.dp_replicate or --nproc")

    @property
    def dp_shard(self) -> int:
        """Shard-group size S = dp / dp_replicate (HSDP; = dp without replication)."""
        return self.dp // self.dp_replicate

    @property
    def degrees(self) -> dict:
        """``{axis: degree}`` for every axis of :data:`AXES`, outermost first."""
        return {a: getattr(self, a) for a in AXES}

    def size(self, name: str) -> int:
        """Degree of an axis or a combined group (:data:`COMBINED`); raises KeyError for an unknown name."""
        name = ALIASES.get(name, name)
        if name in AXES:
            return getattr(self, name)
        if name not in COMBINED:
            raise KeyError(f"unknown group {name!r}; axes {AXES}, combined groups {tuple(COMBINED)}")
        out = 1
        for a in COMBINED[name]:
            out *= getattr(self, a)
        return out

    def coords(self, rank: int) -> dict:
        """Coordinates of global ``rank``: one entry per axis, plus the index of the rank in each
        combined group (``coords["dp"] = dp_replicate * dp_shard_degree + dp_shard``, ...).
        Raises ValueError for a rank outside [0, world_size)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        out, rest = {}, rank
        for a in reversed(AXES):
            rest, out[a] = divmod(rest, getattr(self, a))
        for name, axes in COMBINED.items():
            out[name] = self._index(out, axes)
        return out

    def _index(self, coords: dict, axes) -> int:
        i = 0
        for a in axes:
            i = i * getattr(self, a) + coords[a]
        return i

    def rank(self, **coords) -> int:
        """Global rank at ``coords`` (every axis of :data:`AXES`; ``dp=`` may stand for
        dp_replicate and dp_shard together). Raises ValueError for a missing or out-of-range
        coordinate or an unknown name."""
        c = dict(coords)
        if "dp" in c:
            if "dp_replicate" in c or "dp_shard" in c:
                raise ValueError("give dp, or dp_replicate and dp_shard, not both")
            d = c.pop("dp")
            if not 0 <= d < self.dp:
                raise ValueError(f"coordinate dp={d} is outside [0, {self.dp})")
            c["dp_replicate"], c["dp_shard"] = divmod(d, self.dp_shard)
        unknown = set(c) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axis {sorted(unknown)}; axes are {AXES} (or dp)")
        missing = [a for a in AXES if a not in c]
        if missing:
            raise ValueError(f"missing coordinate(s) {missing}")
        for a in AXES:
            if not 0 <= c[a] < getattr(self, a):
                raise ValueError(f"coordinate {a}={c[a]} is outside [0, {getattr(self, a)})")
        return self._index(c, AXES)

    def peer(self, rank: int, **coords) -> int:
        """Global rank of the process whose coordinates equal ``rank``'s except for ``coords``
        (e.g. ``peer(r, pp=q)``: the same dp/cp/tp position on pipeline stage q). Raises ValueError
        as :meth:`rank` does."""
        own = self.coords(rank)
        keep = {a: own[a] for a in AXES}
        if "dp" in coords:
            keep.pop("dp_replicate")
            keep.pop("dp_shard")
        return self.rank(**{**keep, **coords})

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of axis or combined group ``name``: a list of global-rank lists (each in
        increasing coordinate order), together covering the world once."""
        name = ALIASES.get(name, name)
        if name not in AXES and name not in COMBINED:
            raise KeyError(f"unknown group {name!r}; axes {AXES}, combined groups {tuple(COMBINED)}")
        axes = COMBINED.get(name, (name,))
        others = [a for a in AXES if a not in axes]
        groups: dict = {}
        for r in range(self.world_size):
            c = self.coords(r)
            groups.setdefault(tuple(c[a] for a in others), []).append(r)
        return list(groups.values())
