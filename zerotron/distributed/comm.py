"""The only place zerotron calls torch.distributed collectives.

Every wrapper here
  * refuses non-contiguous tensors (gloo silently reduces the wrong memory for strided views),
  * counts calls and bytes per (op, group) in a process-wide :class:`CommStats`,
  * supports synchronous use (returns ``None``) and asynchronous use (``async_op=True`` returns the
    ``torch.distributed.Work`` handle; call ``.wait()`` before reading the result). Async handles
    are remembered until waited: :func:`pending_works` lists the unfinished ones and
    :func:`wait_pending` (called by ``mesh.teardown`` at the end of a run) waits for them.

Byte accounting follows the nccl-tests convention for the "size" of a collective:
  * all_reduce, broadcast, reduce: the tensor's bytes;
  * all_gather (into tensor): the *output* bytes (world_size x input);
  * reduce_scatter (tensor): the *input* bytes (world_size x output);
  * all_to_all: the input bytes; send/recv: the tensor's bytes.
Bus bandwidth factors for these sizes live in :func:`busbw_factor`.

A ``tag`` (e.g. ``"grad"``, ``"loss_norm"``) can be attached to any call so that tests and metrics
can tell gradient traffic from bookkeeping traffic; stats are keyed by ``(op, group_name, tag)``.

In-flight safety: every asynchronous call is registered (:func:`in_flight`) with the memory it
reads and writes until its handle is waited (or its future handed to torch, e.g. a DDP comm hook).
A collective whose tensors overlap an in-flight one raises at once, and code that reads or writes
memory outside comm (a gradient sum, a free of prefetched storage) calls :func:`assert_idle` first.
This turns a race (a result that depends on timing) into a deterministic error.

Watchdog (a dead or hung peer): every blocking call and every ``wait`` records the collective in
progress on this rank in one per-process slot (:func:`current_op`: op, tag, group name, the group's
global ranks, the trainer's step from :func:`set_step`) and clears it after; no extra collective.
When the call raises (gloo's timeout, a connection reset by a dead peer) it is re-raised as
:class:`CollectiveError`, one line naming op, tag, group, peer ranks and step.

Timeouts: every collective is bounded by ``parallel.timeout_s`` (default 120 s: a dead peer is
reported within about two minutes, not the 30 minutes of torch's default). Waits that are long by
design use :func:`wait_barrier` with their own, longer timeout (:data:`IO_TIMEOUT_S`): the ranks
waiting for local rank 0 to build the token cache. Checkpoint saves are bounded by the collective
timeout too: raise ``parallel.timeout_s`` for multi-GB checkpoints on a slow file system.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

IO_TIMEOUT_S = 1800.0
"""timeout of :func:`wait_barrier` waits that are long by design (building the token cache)"""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a dead or hung peer); ``str()`` is one line naming op,
    tag, group, peers and step. ``.op`` is the :func:`current_op` dict at the failure."""

    def __init__(self, msg: str, op: dict):
        super().__init__(msg)
        self.op = op


_CURRENT: tuple | None = None
_STEP: int | None = None


def set_step(step: int | None) -> None:
    """Tell the watchdog the (1-based) optimizer step now running (the trainer calls this)."""
    global _STEP
    _STEP = step


def current_op() -> dict | None:
    """The collective this process is blocked in right now (dict: op, tag, group, ranks, step), or None."""
    return None if _CURRENT is None else _describe_slot(_CURRENT)


def _describe_slot(slot: tuple) -> dict:
    op, tag, group, step = slot  # the group's ranks are looked up only here, off the hot path
    return {"op": op, "tag": tag, "group": group_name(group), "ranks": _group_ranks(group), "step": step}


def _group_ranks(group) -> list[int]:
    try:
        return list(dist.get_process_group_ranks(_pg(group) or dist.GroupMember.WORLD))
    except (RuntimeError, ValueError, AttributeError):
        return []


def describe_op(op: dict) -> str:
    me = dist.get_rank() if dist.is_initialized() else 0
    peers = [r for r in op["ranks"] if r != me]
    tag = f" (tag {op['tag']!r})" if op["tag"] else ""
    step = f" at step {op['step']}" if op["step"] is not None else ""
    return f"{op['op']}{tag} on group {op['group']} (ranks {op['ranks']}){step}: rank {me} got no answer " \
           f"from peer(s) {peers}"


@contextlib.contextmanager
def _watch(op: str, group, tag: str = ""):
    """Record ``op`` as this rank's collective in progress while the block runs; re-raise its
    failure as a one-line CollectiveError."""
    global _CURRENT
    saved = _CURRENT
    _CURRENT = (op, tag, group, _STEP)  # a tuple: no lookups per call
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        info = _describe_slot(_CURRENT)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CollectiveError(f"{describe_op(info)} (dead or hung peer? {type(e).__name__}: {first})",
                              info) from e
    finally:
        _CURRENT = saved


def wait_barrier(timeout_s: float = IO_TIMEOUT_S, group=None, tag: str = "") -> None:
    """A barrier that may wait up to ``timeout_s`` (longer than the collective timeout) for a rank
    busy on purpose (gloo: ``monitored_barrier``, which also names the ranks that did not arrive)."""
    with _watch("barrier", group, tag):
        if dist.get_backend(_pg(group)) == "gloo":
            dist.monitored_barrier(group=_pg(group), timeout=timedelta(seconds=timeout_s))
        else:
            dist.barrier(group=_pg(group))


@dataclass(frozen=True)
class NamedGroup:
    """A ProcessGroup with the name of the mesh dimension it spans (``"dp"``, ``"tp"``, ``"pp"``).

    Two mesh dimensions may share one underlying ProcessGroup object (e.g. when a degree is 1), so
    the name travels with the handle rather than being looked up from the group."""

    pg: object
    name: str

    def size(self) -> int:
        return dist.get_world_size(self.pg)

    def rank(self) -> int:
        return dist.get_rank(self.pg)


def _pg(group):
    return group.pg if isinstance(group, NamedGroup) else group


def group_name(group) -> str:
    """Accounting name of ``group``: its NamedGroup name, ``"world"`` for ``None``."""
    if isinstance(group, NamedGroup):
        return group.name
    return "world" if group is None or group is dist.GroupMember.WORLD else "group"


@dataclass
class CommStats:
    """Counts of collective calls and bytes, keyed by ``(op, group_name, tag)``.

    ``calls[key]`` is an int; ``bytes[key]`` is an int (bytes, nccl-tests size convention).
    """

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, group, tensor_bytes: int, tag: str = "") -> None:
        key = (op, group_name(group), tag)
        self.calls[key] += 1
        self.bytes[key] += int(tensor_bytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def total_bytes(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        """Sum of bytes over keys matching the given filters (``None`` matches anything)."""
        return sum(v for k, v in self.bytes.items() if _match(k, op, group, tag))

    def total_calls(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        """Sum of call counts over keys matching the given filters."""
        return sum(v for k, v in self.calls.items() if _match(k, op, group, tag))

    def snapshot(self) -> dict:
        """A JSON-friendly copy: ``{"op/group/tag": {"calls": n, "bytes": b}}``."""
        return {"/".join(k): {"calls": self.calls[k], "bytes": self.bytes[k]} for k in sorted(self.calls)}


def _match(key, op, group, tag) -> bool:
    return (op is None or key[0] == op) and (group is None or key[1] == group) and (tag is None or key[2] == tag)


STATS = CommStats()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses a tensor can touch (its whole storage if not contiguous)."""
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


class TrackedWork:
    """A ``torch.distributed.Work`` registered as in flight until :meth:`wait` (or
    :meth:`get_future`, which hands completion to torch). Other attributes are the Work's."""

    def __init__(self, work, op: str, tag: str, tensors, group=None):
        self.work, self.op, self.tag, self.group = work, op, tag, group
        self.spans = [_span(t) for t in tensors if t.numel()]
        _IN_FLIGHT.append(self)

    def _done(self) -> None:
        if self in _IN_FLIGHT:
            _IN_FLIGHT.remove(self)

    def wait(self, *args, **kwargs):
        with _watch(self.op, self.group, self.tag):
            out = self.work.wait(*args, **kwargs)
        self._done()
        return out

    def get_future(self):
        self._done()
        return self.work.get_future()

    def __getattr__(self, name):
        return getattr(self.work, name)


_IN_FLIGHT: list = []


def in_flight() -> list:
    """The asynchronous collectives issued through this module and not yet waited (TrackedWork)."""
    return list(_IN_FLIGHT)


def assert_idle(tensors, what: str) -> None:
    """Raise RuntimeError if any of ``tensors`` overlaps the memory of an in-flight asynchronous
    collective (``what`` names the code about to touch them). Cost: O(#tensors x #in-flight)."""
    if not _IN_FLIGHT:
        return
    for t in tensors:
        if t is None or not t.numel():
            continue
        a, b = _span(t)
        for w in _IN_FLIGHT:
            if any(a < e and s < b for s, e in w.spans):
                raise RuntimeError(f"{what}: a tensor of shape {tuple(t.shape)} overlaps the memory of an "
                                   f"in-flight async {w.op} (tag {w.tag!r}); wait for it first")


def pending_works() -> list:
    """In-flight async collectives (not yet waited) that have not completed either."""
    return [w for w in _IN_FLIGHT if not w.is_completed()]


def wait_pending() -> int:
    """Wait for every in-flight async collective issued through this module (``mesh.teardown`` at
    the end of a run); returns how many had not completed. Raises what ``Work.wait`` raises, e.g. a
    timeout RuntimeError when a peer never joins the collective."""
    n = 0
    while _IN_FLIGHT:
        w = _IN_FLIGHT[0]
        n += not w.is_completed()
        w.wait()
        w._done()
    return n


def _track(work, op: str, tag: str, *tensors, group=None):
    return TrackedWork(work, op, tag, tensors, group) if work is not None else None



def _w(op: str, group, tag: str, async_op: bool = False):
    """The watchdog for a blocking call; nothing for an async one (its ``wait`` is watched)."""
    return contextlib.nullcontext() if async_op else _watch(op, group, tag)


def _check(t: torch.Tensor, what: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"{what}: tensor of shape {tuple(t.shape)} is not contiguous; call .contiguous() first "
            "(gloo silently reduces the wrong elements of strided views)"
        )
    assert_idle([t], what)
    return t.numel() * t.element_size()


def _world(group) -> int:
    return dist.get_world_size(_pg(group))


def all_reduce(t: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, tag: str = ""):
    """In-place all-reduce of ``t`` (any shape) over ``group``. Returns a Work handle if ``async_op``."""
    STATS.record("all_reduce", group, _check(t, "all_reduce"), tag)
    with _w("all_reduce", group, tag, async_op):
        work = dist.all_reduce(t, op=op, group=_pg(group), async_op=async_op)
    return _track(work, "all_reduce", tag, t, group=group)


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
    return _track(work, "broadcast", tag, t, group=group)


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
    return _track(work, "all_gather", tag, output, inp, group=group)


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
    return _track(work, "reduce_scatter", tag, output, inp, group=group)


def all_to_all(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False, tag: str = ""):
    """Equal-split all-to-all of flat tensors (``inp.numel()`` divisible by world size)."""
    nbytes = _check(inp, "all_to_all input")
    _check(output, "all_to_all output")
    STATS.record("all_to_all", group, nbytes, tag)
    with _w("all_to_all", group, tag, async_op):
        work = dist.all_to_all_single(output, inp, group=_pg(group), async_op=async_op)
    return _track(work, "all_to_all", tag, output, inp, group=group)


def send(t: torch.Tensor, dst: int, group=None, tag: str = "") -> None:
    """Blocking point-to-point send to global rank ``dst``."""
    STATS.record("send", group, _check(t, "send"), tag)
    with _watch("send", group, tag):
        dist.send(t, dst=dst, group=_pg(group))


def recv(t: torch.Tensor, src: int, group=None, tag: str = "") -> None:
    """Blocking point-to-point receive into ``t`` from global rank ``src``."""
    STATS.record("recv", group, _check(t, "recv"), tag)
    with _watch("recv", group, tag):
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
    with _watch("barrier", group):
        dist.barrier(group=_pg(group))


def all_gather_object(obj, group=None) -> list:
    """Gather any picklable object from every rank of ``group`` (control plane; counted as 0 bytes)."""
    out = [None] * _world(group)
    STATS.record("all_gather_object", group, 0)
    with _watch("all_gather_object", group):
        dist.all_gather_object(out, obj, group=_pg(group))
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """Broadcast a picklable object from global rank ``src``; returns it on every rank."""
    box = [obj]
    STATS.record("broadcast_object", group, 0)
    with _watch("broadcast_object", group):
        dist.broadcast_object_list(box, src=src, group=_pg(group))
    return box[0]


def busbw_factor(op: str, n: int) -> float:
    """Bus-bandwidth factor of the nccl-tests convention (busbw = algbw x factor) for ``n`` ranks.

    all_reduce 2(n-1)/n; all_gather, reduce_scatter and all_to_all (n-1)/n; broadcast, reduce,
    send/recv 1. Source: NVIDIA nccl-tests, doc/PERFORMANCE.md.
    Raises ValueError for an unknown op."""
    if n < 1:
        raise ValueError(f"busbw_factor: n must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "p2p"):
        return 1.0
    raise ValueError(f"busbw_factor: unknown op {op!r}")
