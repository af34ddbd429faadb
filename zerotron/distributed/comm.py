"""The only place zerotron calls torch.distributed collectives.

Every wrapper here
  * refuses non-contiguous tensors (gloo silently reduces the wrong memory for strided views),
    meta tensors and tensors addressing more bytes than their storage holds (freed memory, e.g. a
    ZeRO-3 buffer at rest: gloo would read or write past the allocation or through a null pointer),
  * counts calls and bytes per (op, group) in a process-wide :class:`CommStats`
    (``distributed.accounting``: the nccl-tests size convention, bus-bandwidth factors),
  * supports synchronous use (returns ``None``) and asynchronous use (``async_op=True`` returns the
    ``torch.distributed.Work`` handle; call ``.wait()`` before reading the result). Async handles
    are remembered until waited (``distributed.inflight``: :func:`pending_works` lists the
    unfinished ones and :func:`wait_pending`, called by ``mesh.teardown`` at the end of a run,
    waits for them; a collective or :func:`assert_idle` on memory an in-flight one touches raises).

A ``tag`` (e.g. ``"grad"``, ``"loss_norm"``) can be attached to any call so that tests and metrics
can tell gradient traffic from bookkeeping traffic; stats are keyed by ``(op, group_name, tag)``.

Watchdog (``distributed.watchdog``, a dead or hung peer): every blocking call and every ``wait``
records the collective in progress on this rank (:func:`current_op`) and re-raises a failure as
:class:`CollectiveError`, one line naming op, tag, group, peer ranks and step.

Timeouts: every collective is bounded by ``parallel.timeout_s`` (default 120 s: a dead peer is
reported within about two minutes, not the 30 minutes of torch's default). Waits that are long by
design use :func:`wait_barrier` with their own, longer timeout (:data:`IO_TIMEOUT_S`): the ranks
waiting for local rank 0 to build the token cache. Checkpoint saves are bounded by the collective
timeout too, background (``checkpoint.async_save``) ones included: raise ``parallel.timeout_s`` for
multi-GB checkpoints on a slow file system. Groups made outside the mesh take that timeout through
:func:`new_group` (torch's ``dist.new_group`` alone gives them 30 minutes).

Besides the collectives, ``comm.NamedGroup``, ``comm.new_group``, ``comm.STATS``, ``comm.assert_idle`` and
``comm.set_step`` (defined in ``groups``, ``accounting``, ``inflight`` and ``watchdog`` beside it)
are where the parallel code and the trainer take them from; import anything else of those modules
from its module.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from .accounting import STATS
from .groups import NamedGroup, new_group
from .groups import process_group as _pg
from .inflight import assert_idle, track
from .watchdog import set_step, watch

# with the collectives, the names the parallel code and the trainer use as comm.X (defined beside)
__all__ = ["IO_TIMEOUT_S", "STATS", "NamedGroup", "ReduceOp", "all_gather", "all_gather_object", "all_reduce",
           "all_reduce_in", "all_to_all", "all_to_all_v", "assert_idle", "barrier", "batch_isend_irecv", "broadcast",
           "broadcast_object", "irecv", "isend", "new_group", "recv", "reduce_scatter", "send", "set_step", "summer",
           "wait_barrier"]

ReduceOp = dist.ReduceOp

IO_TIMEOUT_S = 1800.0
"""timeout of :func:`wait_barrier` waits that are long by design (building the token cache)"""


def wait_barrier(timeout_s: float = IO_TIMEOUT_S, group=None, tag: str = "") -> None:
    """A barrier that may wait up to ``timeout_s`` (longer than the collective timeout) for a rank
    busy on purpose (gloo: ``monitored_barrier``, which also names the ranks that did not arrive)."""
    with watch("barrier", group, tag):
        if dist.get_backend(_pg(group)) == "gloo":
            dist.monitored_barrier(group=_pg(group), timeout=timedelta(seconds=timeout_s))
        else:
            dist.barrier(group=_pg(group))


def _w(op: str, group, tag: str, async_op: bool = False):
    """The watchdog for a blocking call; nothing for an async one (its ``wait`` is watched)."""
    return contextlib.nullcontext() if async_op else watch(op, group, tag)


def _check(t: torch.Tensor, what: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"{what}: tensor of shape {tuple(t.shape)} is not contiguous; call .contiguous() first "
            "(gloo silently reduces the wrong elements of strided views)"
        )
    if t.device.type == "meta":  # (a fake tensor of the dry run reports its fake device)
        raise ValueError(f"{what}: tensor of shape {tuple(t.shape)} is on the meta device, it has no memory "
                         "(e.g. a parameter of another pipeline stage outside full_params())")
    nbytes = t.numel() * t.element_size()
    if nbytes and getattr(t, "fake_mode", None) is None and \
            t.storage_offset() * t.element_size() + nbytes > t.untyped_storage().nbytes():
        raise ValueError(f"{what}: tensor of shape {tuple(t.shape)} addresses {nbytes} bytes at offset "
                         f"{t.storage_offset() * t.element_size()} of a storage of {t.untyped_storage().nbytes()} "
                         "bytes (freed memory: resize its storage before the collective)")
    assert_idle([t], what)
    return nbytes


def _world(group) -> int:
    return dist.get_world_size(_pg(group))


def all_reduce(t: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, tag: str = ""):
    """In-place all-reduce of ``t`` (any shape) over ``group``. Returns a Work handle if ``async_op``."""
    STATS.record("all_reduce", group, _check(t, "all_reduce"), tag)
    with _w("all_reduce", group, tag, async_op):
        work = dist.all_reduce(t, op=op, group=_pg(group), async_op=async_op)
    return track(work, "all_reduce", tag, t, group=group)


def all_reduce_in(t: torch.Tensor, dtype: torch.dtype, op=ReduceOp.SUM, group=None, tag: str = "") -> None:
    """Synchronous in-place all-reduce of ``t`` (any shape) computed in ``dtype``: directly when
    ``t`` has that dtype, else on a cast copy whose result is cast back into ``t`` (e.g. fp32
    gradient shards reduced in a bf16 ``parallel.reduce_dtype``, or bf16 ones in fp32)."""
    if t.dtype == dtype:
        all_reduce(t, op=op, group=group, tag=tag)
        return
    buf = t.to(dtype)
    all_reduce(buf, op=op, group=group, tag=tag)
    t.copy_(buf)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False, tag: str = ""):
    """In-place broadcast of ``t`` from global rank ``src``."""
    STATS.record("broadcast", group, _check(t, "broadcast"), tag)
    with _w("broadcast", group, tag, async_op):
        work = dist.broadcast(t, src=src, group=_pg(group), async_op=async_op)
    return track(work, "broadcast", tag, t, group=group)


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group=None, tag: str = "") -> None:
    """Synchronous in-place broadcast of every tensor of ``tensors`` from global rank ``src`` in one
    collective per dtype: the tensors of one dtype are copied into one flat buffer, broadcast, and
    copied back on the other ranks (a pure copy: the same bits as one :func:`broadcast` each, with
    one gloo round trip instead of one per tensor). Every rank passes tensors of the same shapes
    and dtypes in the same order; counted as one "broadcast" of the flat buffer's bytes per dtype."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    me = dist.get_rank()
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        broadcast(flat, src=src, group=group, tag=tag)
        if me != src:
            for t, v in zip(ts, flat.split([t.numel() for t in ts])):
                t.detach().copy_(v.view_as(t))


def all_gather(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False, tag: str = ""):
    """Gather equal-size flat shards: ``output`` is 1-D with ``world_size * inp.numel()`` elements.

    Raises ValueError if ``output`` is not 1-D of the right size (gloo rejects 2-D outputs)."""
    n = _world(group)
    _check(inp, "all_gather input")
    nbytes = _check(output, "all_gather output")
    if output.dim() != 1 or output.numel() != n * inp.numel():
        raise ValueError(f"all_gather: output must be 1-D with {n}x{inp.numel()} elements, got {tuple(output.shape)}")
    STATS.record("all_gather", group, nbytes, tag)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with _w("all_gather", group, tag, async_op):
        work = fn(output, inp.reshape(-1), group=_pg(group), async_op=async_op)
    return track(work, "all_gather", tag, output, inp, group=group)


def reduce_scatter(output: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   tag: str = ""):
    """Reduce the flat ``inp`` (``world_size * output.numel()`` elements) and scatter equal shards.

    Rank r receives the reduced elements ``[r*k, (r+1)*k)`` where ``k = output.numel()``."""
    n = _world(group)
    _check(output, "reduce_scatter output")
    nbytes = _check(inp, "reduce_scatter input")
    if inp.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input must have {n}x{output.numel()} elements, got {inp.numel()}")
    STATS.record("reduce_scatter", group, nbytes, tag)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with _w("reduce_scatter", group, tag, async_op):
        work = fn(output.reshape(-1), inp.reshape(-1), op=op, group=_pg(group), async_op=async_op)
    return track(work, "reduce_scatter", tag, output, inp, group=group)


def all_to_all(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False, tag: str = ""):
    """Equal-split all-to-all of flat tensors (``inp.numel()`` divisible by world size)."""
    nbytes = _check(inp, "all_to_all input")
    _check(output, "all_to_all output")
    STATS.record("all_to_all", group, nbytes, tag)
    with _w("all_to_all", group, tag, async_op):
        work = dist.all_to_all_single(output, inp, group=_pg(group), async_op=async_op)
    return track(work, "all_to_all", tag, output, inp, group=group)


def count(op: str, group, nbytes: int, tag: str = "") -> None:
    """Record a collective that another library issues itself (torch FSDP2's all-gathers and
    reduce-scatters, through ``zerotron.parallel.data.fsdp_comm``): ``op`` (all_gather,
    reduce_scatter, ...), ``group`` (a NamedGroup), ``nbytes`` in the nccl-tests convention of the
    module docstring. Counts only; the caller runs the collective."""
    STATS.record(op, group, int(nbytes), tag)


def all_to_all_v(output: torch.Tensor, inp: torch.Tensor, output_splits: list[int], input_splits: list[int],
                 group=None, tag: str = "") -> None:
    """Uneven all-to-all along dim 0 (blocking): rank r sends rows ``input_splits[j]`` (a
    contiguous block, in rank order) of ``inp`` to rank j and receives ``output_splits[j]`` rows
    from rank j into ``output``. Both sides must agree on the splits (exchange the counts first,
    e.g. with :func:`all_to_all`). Counted as the bytes this rank sends. gloo (torch 2.13) and NCCL
    take split sizes in ``all_to_all_single``; gloo's list form needs equal sizes."""
    nbytes = _check(inp, "all_to_all_v input")
    _check(output, "all_to_all_v output")
    STATS.record("all_to_all", group, nbytes, tag)
    with _w("all_to_all", group, tag):
        dist.all_to_all_single(output, inp, output_split_sizes=list(output_splits),
                               input_split_sizes=list(input_splits), group=_pg(group))


def send(t: torch.Tensor, dst: int, group=None, tag: str = "") -> None:
    """Blocking point-to-point send to global rank ``dst``."""
    STATS.record("send", group, _check(t, "send"), tag)
    with watch("send", group, tag):
        dist.send(t, dst=dst, group=_pg(group))


def recv(t: torch.Tensor, src: int, group=None, tag: str = "") -> None:
    """Blocking point-to-point receive into ``t`` from global rank ``src``."""
    STATS.record("recv", group, _check(t, "recv"), tag)
    with watch("recv", group, tag):
        dist.recv(t, src=src, group=_pg(group))


def isend(t: torch.Tensor, dst: int, group=None, tag: str = ""):
    """Asynchronous point-to-point send of ``t`` to global rank ``dst``: the Work handle (wait on
    it before writing ``t`` again). One op without ``batch_isend_irecv``'s per-batch set-up."""
    STATS.record("send", group, _check(t, "send"), tag)
    return dist.isend(t, dst=dst, group=_pg(group))


def irecv(t: torch.Tensor, src: int, group=None, tag: str = ""):
    """Asynchronous point-to-point receive into ``t`` from global rank ``src``: the Work handle
    (wait on it before reading ``t``). Receives from one peer match its sends in posting order."""
    STATS.record("recv", group, _check(t, "recv"), tag)
    return dist.irecv(t, src=src, group=_pg(group))


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int]], group=None, tag: str = "") -> list:
    """Post a batch of point-to-point ops; ``ops`` is a list of ``("send"|"recv", tensor, peer_rank)``.

    Returns the list of Work handles (wait on all of them before using received tensors)."""
    p2p = []
    for kind, t, peer in ops:
        STATS.record(kind, group, _check(t, kind), tag)
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, t, peer, group=_pg(group)))
    return dist.batch_isend_irecv(p2p) if p2p else []


def barrier(group=None) -> None:
    """Synchronise all ranks of ``group`` (not counted as traffic)."""
    with watch("barrier", group):
        dist.barrier(group=_pg(group))


def all_gather_object(obj, group=None) -> list:
    """Gather any picklable object from every rank of ``group`` (control plane; counted as 0 bytes)."""
    out = [None] * _world(group)
    STATS.record("all_gather_object", group, 0)
    with watch("all_gather_object", group):
        dist.all_gather_object(out, obj, group=_pg(group))
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """Broadcast a picklable object from global rank ``src``; returns it on every rank."""
    box = [obj]
    STATS.record("broadcast_object", group, 0)
    with watch("broadcast_object", group):
        dist.broadcast_object_list(box, src=src, group=_pg(group))
    return box[0]


def summer(group, tag: str = ""):
    """A callable ``t -> sum of t over group`` (a new tensor, ``t`` untouched, no gradient): one
    synchronous all-reduce per call, e.g. the per-micro-batch router statistics of the MoE layers
    under sequence / context parallelism (``models.layout.add_token_sum``)."""
    def total(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        all_reduce(out, group=group, tag=tag)
        return out
    return total
