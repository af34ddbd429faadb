"""In-flight safety of comm's asynchronous collectives.

Every asynchronous call is registered (:func:`in_flight`) with the memory it reads and writes
until its handle is waited (or its future handed to torch, e.g. a DDP comm hook). A collective
whose tensors overlap an in-flight one raises at once, and code that reads or writes memory outside
comm (a gradient sum, a free of prefetched storage) calls :func:`assert_idle` first. This turns a
race (a result that depends on timing) into a deterministic error. :func:`pending_works` lists the
unfinished handles and :func:`wait_pending` (called by ``mesh.teardown`` at the end of a run)
waits for them.
"""
from __future__ import annotations

import torch

from .watchdog import watch


def span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses a tensor can touch (its whole storage if not contiguous). A
    storage without memory (fake or meta tensors of a dry run, ``analysis.dryrun``)
    is placed at its StorageImpl's address shifted past any real address, so distinct storages stay
    disjoint and views of one storage overlap as they would in memory."""
    st = t.untyped_storage()
    fake = t.is_meta or getattr(t, "fake_mode", None) is not None
    base = st._cdata << 64 if fake else st.data_ptr()
    if t.is_contiguous():
        start = base + t.storage_offset() * t.element_size()
        return start, start + t.numel() * t.element_size()
    return base, base + st.nbytes()


class TrackedWork:
    """A ``torch.distributed.Work`` registered as in flight until :meth:`wait` (or
    :meth:`get_future`, which hands completion to torch). Other attributes are the Work's."""

    def __init__(self, work, op: str, tag: str, tensors, group=None):
        self.work, self.op, self.tag, self.group = work, op, tag, group
        self.spans = [span(t) for t in tensors if t.numel()]
        _IN_FLIGHT.append(self)

    def _done(self) -> None:
        if self in _IN_FLIGHT:
            _IN_FLIGHT.remove(self)

    def wait(self, *args, **kwargs):
        with watch(self.op, self.group, self.tag):
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
        a, b = span(t)
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


def track(work, op: str, tag: str, *tensors, group=None):
    """``work`` registered as in flight (a :class:`TrackedWork`), or None for a synchronous call."""
    return TrackedWork(work, op, tag, tensors, group) if work is not None else None
