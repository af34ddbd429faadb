"""Process-group set-up: ``ParallelDims`` (the axes table, ``zerotron.dims``) -> one DeviceMesh.

The mesh is built once over the axes (pp, dp_replicate, dp_shard, cp, tp), outermost to innermost:
tp varies fastest, so tensor-parallel peers are neighbouring ranks (same node, fastest links), as in
Megatron-LM and picotron. The engine's combined groups (dp, batch, loss, shard, replicate) are
flattened out of the same mesh (``DeviceMesh._flatten``, as torchtitan does), so HSDP needs no
second mesh: with ``parallel.dp_replicate = R > 1`` the dp group factors as R replicas x S shards,
the shard group holding neighbouring ranks -- normally one node -- and the replicate group crossing
nodes. Global rank numbering: ``zerotron.dims``.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..dims import ALIASES, AXES, COMBINED, ParallelDims
from ..launch_worker import die_with_parent, in_worker
from ..multinode_check import check_multinode_addresses
from . import comm, inflight

__all__ = ["Mesh", "ParallelDims", "init_distributed", "default_device", "teardown", "destroy"]


def default_device() -> torch.device:
    """The device this process should use: ``cuda:<LOCAL_RANK>`` when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(backend: str = "auto", timeout_s: float = 1800.0, device: torch.device | None = None):
    """Initialise the default process group once and return ``(rank, world_size, device)``.

    Under torchrun / the elastic launcher the env vars RANK, WORLD_SIZE, MASTER_ADDR/PORT are used.
    Without them a single-process group (world size 1) is created in memory so that every code
    path is the same for one process. ``backend="auto"``: NCCL on CUDA, gloo on CPU.
    ``timeout_s`` bounds every collective: if a peer dies the others raise within it instead of
    hanging."""
    device = device or default_device()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if in_worker():  # torchrun / the elastic launcher set RANK and WORLD_SIZE
            die_with_parent()  # a killed launcher takes its workers with it
            _check_addresses(backend)
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def _check_addresses(backend: str) -> None:
    """Before a multi-node init: one warning line per address problem (local rank 0 says it), or,
    where the run certainly cannot connect, that line as an error and exit code 2
    (:func:`zerotron.multinode_check.check_multinode_addresses`)."""

    lines, certain = check_multinode_addresses(backend)
    if lines and os.environ.get("LOCAL_RANK", "0") == "0":
        for line in lines:
            print(f"zerotron: {'error' if certain else 'warning'}: {line}", file=sys.stderr, flush=True)
    if certain:
        raise SystemExit(2)


# groups are built in this order; a later group spanning the same axes (of degree > 1) as an earlier one is
# that group (so with dp_replicate = 1 and cp = 1 "shard" is "dp", and comm accounting keeps one label)
_BUILD_ORDER = ("pp", "tp", "dp", "dp_replicate", "dp_shard", "cp", "batch", "loss", "shard", "replicate")
_LABELS = {"dp_replicate": "dp_rep"}  # accounting label of the HSDP replica axis (as before the axes table)


class Mesh:
    """One torch ``DeviceMesh`` over the axes of ``dims`` (``zerotron.dims.AXES``: pp, dp_replicate,
    dp_shard, cp, tp) and the combined groups flattened out of it (``zerotron.dims.COMBINED``: dp,
    batch, loss, shard, replicate), built once; the single source of truth for who talks to whom.

    Attributes: ``dims`` (ParallelDims), ``mesh`` (the torch DeviceMesh; ``mesh["dp"]`` etc. are its
    flattened 1-D sub-meshes), ``rank``, ``coords`` (this rank's coordinates, axes and combined
    groups: ``coords["dp"]``, ``coords["tp"]``, ...), ``device``, ``hsdp_mesh`` (the 2-D
    (dp_replicate, dp_shard) sub-mesh for FSDP2's HSDP, or None without replication).
    ``group(name)`` is the ``comm.NamedGroup`` of an axis or combined group, ``size(name)`` /
    ``local_rank(name)`` its degree and this rank's index in it, ``peer(**coords)`` a global rank."""

    def __init__(self, dims: ParallelDims, device: torch.device, device_mesh=None):
        """Collective over the whole default group. ``device_mesh``: a DeviceMesh over ``AXES`` of
        ranks 0 .. dims.world_size-1 built on every rank (a sub-world of a larger job, as ``zerotron
        bench`` runs smaller layouts inside its world); ranks outside it take part in creating the
        groups and are then no member (:meth:`member`)."""
        from torch.distributed.device_mesh import init_device_mesh

        self.dims = dims
        self.device = device
        self.rank = dist.get_rank()
        inside = self.rank < dims.world_size
        self.coords = dims.coords(self.rank) if inside else None
        self.mesh = device_mesh if device_mesh is not None else init_device_mesh(
            device.type, tuple(dims.degrees.values()), mesh_dim_names=AXES)
        self._groups: dict[str, comm.NamedGroup] = {}
        self._dim_names: dict[str, str] = {}  # group name -> the name of its 1-D mesh dimension in self.mesh
        self._sub: dict[str, object] = {}  # group name -> its 1-D DeviceMesh (the flattened one as _flatten returned it)
        by_axes: dict[tuple, str] = {}  # the axes of degree > 1 a group spans -> the group built for them
        for name in _BUILD_ORDER:  # collective: every rank builds (or aliases) the same groups in order
            axes = COMBINED.get(name, (name,))
            key = tuple(a for a in axes if dims.size(a) > 1)
            if key and key in by_axes:  # the same ranks as a group already built: one group, one label
                self._groups[name], self._dim_names[name] = self._groups[by_axes[key]], self._dim_names[by_axes[key]]
                self._sub[name] = self._sub[by_axes[key]]
                continue
            sub = self.mesh[axes[0]] if len(axes) == 1 else self.mesh[axes]._flatten(name)
            self._groups[name] = comm.NamedGroup(sub.get_group() if inside else None, _LABELS.get(name, name))
            self._dim_names[name] = axes[0] if len(axes) == 1 else name
            self._sub[name] = sub
            if key:
                by_axes[key] = name
        # FSDP2's 2-D (replicate, shard) mesh; the shard dimension is dp_shard x cp (dp_shard without cp)
        shard_dim = "dp_shard" if dims.cp == 1 else self._dim_names["shard"]
        self.hsdp_mesh = self.mesh["dp_replicate", shard_dim] if dims.dp_replicate > 1 and inside else None

    @property
    def member(self) -> bool:
        """Whether this process is one of the mesh's ranks (always, unless built over a sub-world)."""
        return self.coords is not None

    def group(self, name: str) -> comm.NamedGroup | None:
        """Named process group of an axis or combined group (pass it to comm.*). Compatibility
        names: "dp_rep" is the replicate group or None without HSDP replication (the engine's
        test for a hierarchical reduction); raises KeyError for an unknown name."""
        if name == "dp_rep":
            return self._groups["replicate"] if self.dims.dp_replicate > 1 else None
        return self._groups[name]

    def device_mesh(self, name: str):
        """The 1-D torch DeviceMesh of an axis or combined group (``self.mesh[...]`` under the name it
        was built with: "shard" is "dp" without cp and HSDP), e.g. for FSDP2's ``fully_shard``. The
        flattened meshes are the ones ``_flatten`` returned (slicing a flattened dimension from the
        root mesh is deprecated in torch)."""
        return self._sub[ALIASES.get(name, name)]

    def pg(self, name: str):
        """Raw torch ProcessGroup of an axis or combined group (for torch's own DDP/FSDP2)."""
        return self._groups[ALIASES.get(name, name)].pg

    def size(self, name: str) -> int:
        """Degree of an axis or combined group."""
        return self.dims.size(name)

    def local_rank(self, name: str) -> int:
        """This rank's index in the group of an axis or combined group."""
        return self.coords[ALIASES.get(name, name)]

    def peer(self, **coords) -> int:
        """Global rank of the process at this rank's coordinates with ``coords`` replaced, e.g.
        ``peer(pp=q)`` (same dp, cp, tp on stage q) or ``peer(dp=0)`` (the first data-parallel
        replica). Raises ValueError for an out-of-range coordinate or unknown axis."""
        return self.dims.peer(self.rank, **coords)

    @property
    def is_logging_rank(self) -> bool:
        """True on global rank 0 (writes metrics, prints)."""
        return self.rank == 0


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions. They are keyed by specs whose DeviceMesh compares
    equal by shape and dimension names, so after the process groups are destroyed, a later mesh of
    the same shape (the next layout of a parity spawn, the next job of a pooled test rank) would get
    output specs that name the destroyed groups ("Could not resolve the process group"), and the
    cached redistribute planners keep those groups (and their threads) alive. The caches are
    private to torch; clears what exists, and nothing when DTensor was never imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _redistribute

    prop = DTensor._op_dispatcher.sharding_propagator
    for fn in (getattr(prop, "propagate_op_sharding", None), getattr(prop, "_propagate_tensor_meta_cached", None),
               getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    # redistribute planners and mesh topologies hold their DeviceMesh, whose registry holds the
    # process groups: a destroyed gloo group kept alive keeps three threads, one polling every 10 ms
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
    from torch.distributed.tensor import _collective_utils

    topo = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    if hasattr(topo, "cache_clear"):
        topo.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if clear_native is not None:
        clear_native()


def release_destroyed_groups() -> None:
    """Drop torch's last references to destroyed subgroups. ``destroy_process_group(pg)`` leaves a
    group in the private tag registry (``_world.tags_to_pg``) when it was registered under two
    tags (torch 2.13), so the group, its gloo device and threads live on: after a few dozen
    layouts in one process, hundreds of threads each waking every 10 ms take most of the CPU."""
    from torch.distributed import distributed_c10d as c10d

    live = set(c10d._world.pg_map)
    for tag, pgs in list(c10d._world.tags_to_pg.items()):
        pgs[:] = [pg for pg in pgs if pg in live]
        if not pgs:
            del c10d._world.tags_to_pg[tag]


def destroy() -> None:
    """Tear down the default process group (and with it every subgroup) if one exists (no
    synchronisation: after an error), and DTensor's caches that name those groups."""
    if dist.is_initialized():
        dist.destroy_process_group()
        clear_dtensor_caches()


def teardown() -> None:
    """The orderly end of a successful run, on every rank: wait for this rank's outstanding async
    collectives (``inflight.wait_pending``), a barrier over all ranks (no rank tears its process group
    down while a peer may still talk to it; exiting without teardown, or before the peers, can
    abort with "terminate called without an active exception"), then :func:`destroy`. Does
    nothing without a process group. Raises RuntimeError from the wait or the barrier (e.g. the
    collective timeout when a peer died)."""
    if not dist.is_initialized():
        return
    inflight.wait_pending()
    comm.barrier()
    destroy()
