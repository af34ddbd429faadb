"""Process-group set-up: ``ParallelDims`` -> one DeviceMesh over ("pp", "dp", "tp").

The mesh is built once and is the single source of truth for who talks to whom. tp is the innermost
(fastest-varying) dimension so tensor-parallel peers are neighbouring ranks (same node, fastest
links), as in Megatron-LM and picotron; pp is outermost.

Global rank of coordinates (p, d, t) = (p * dp + d) * tp + t.

Hierarchical data parallelism (HSDP, ``parallel.dp_replicate = R > 1``): the dp dimension factors
as R replicas x S = dp / R shards, d = r * S + s, so the shard group (s varies) holds neighbouring
ranks -- normally one node -- and the replicate group (r varies) crosses nodes. Groups "dp_shard"
and "dp_rep" (built from a second (pp, dp_rep, dp_shard, tp) DeviceMesh); with R = 1 "dp_shard" is
the dp group and "dp_rep" is None.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..launch import check_multinode_addresses, die_with_parent
from ..plan import ParallelDims
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
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            die_with_parent()  # a killed launcher takes its workers with it
            _check_addresses(backend)
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def _check_addresses(backend: str) -> None:
    """Before a multi-node init: one warning line per address problem (local rank 0 says it), or,
    where the run certainly cannot connect, that line as an error and exit code 2
    (:func:`zerotron.launch.check_multinode_addresses`)."""

    lines, certain = check_multinode_addresses(backend)
    if lines and os.environ.get("LOCAL_RANK", "0") == "0":
        for line in lines:
            print(f"zerotron: {'error' if certain else 'warning'}: {line}", file=sys.stderr, flush=True)
    if certain:
        raise SystemExit(2)


class Mesh:
    """The ("pp", "dp", "tp") DeviceMesh plus handy per-dimension accessors.

    Attributes: ``dims`` (ParallelDims), ``mesh`` (torch DeviceMesh), ``rank``, ``coords``
    ({"pp","dp","tp"} -> int), ``device``. ``group(name)`` returns the ProcessGroup of a dimension,
    ``size(name)``/``local_rank(name)`` its degree and this rank's index in it."""

    def __init__(self, dims: ParallelDims, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        self.dims = dims
        self.device = device
        self.rank = dist.get_rank()
        self.coords = dims.coords(self.rank)
        self.mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
        self._groups = {name: comm.NamedGroup(self.mesh.get_group(name), name) for name in ("pp", "dp", "tp")}
        self._add_hsdp_groups(lambda shape, names: init_device_mesh(device.type, shape, mesh_dim_names=names))

    def _add_hsdp_groups(self, make) -> None:
        """Groups "dp_shard"/"dp_rep" (HSDP, see the module doc) and ``hsdp_mesh`` (the 2-D
        (dp_rep, dp_shard) DeviceMesh of this rank, for FSDP2; None without replication).
        ``make(shape, names)`` builds a DeviceMesh over this mesh's ranks (collective)."""
        d = self.dims
        self.hsdp_mesh = None
        self._groups["dp_shard"], self._groups["dp_rep"] = self._groups["dp"], None
        if d.dp_replicate > 1:
            m4 = make((d.pp, d.dp_replicate, d.dp_shard, d.tp), ("pp", "dp_rep", "dp_shard", "tp"))
            for name in ("dp_shard", "dp_rep"):
                self._groups[name] = comm.NamedGroup(m4.get_group(name), name)
            self.hsdp_mesh = m4["dp_rep", "dp_shard"]

    def group(self, name: str) -> comm.NamedGroup:
        """Named process group of dimension ``name`` in {"pp", "dp", "tp", "dp_shard", "dp_rep"}
        (pass it to comm.*; "dp_rep" is None without HSDP replication)."""
        return self._groups[name]

    def pg(self, name: str):
        """Raw torch ProcessGroup of dimension ``name`` (for torch's own DDP/FSDP2)."""
        return self._groups[name].pg

    def size(self, name: str) -> int:
        return {"dp_rep": self.dims.dp_replicate}.get(name) or getattr(self.dims, name)

    def local_rank(self, name: str) -> int:
        return self.coords[name]

    def global_rank(self, pp: int, dp: int, tp: int) -> int:
        """Global rank at coordinates (pp, dp, tp)."""
        return (pp * self.dims.dp + dp) * self.dims.tp + tp

    @property
    def is_logging_rank(self) -> bool:
        """True on global rank 0 (writes metrics, prints)."""
        return self.rank == 0


def destroy() -> None:
    """Tear down the default process group if one exists (no synchronisation: after an error)."""
    if dist.is_initialized():
        dist.destroy_process_group()


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
