"""The watchdog of comm: which collective this rank is blocked in, for a dead or hung peer.

Every blocking call and every ``wait`` records the collective in progress on this rank in one
per-process slot (:func:`current_op`: op, tag, group name, the group's global ranks, the trainer's
step from :func:`set_step`) and clears it after; no extra collective. When the call raises (gloo's
timeout, a connection reset by a dead peer) it is re-raised as :class:`CollectiveError`, one line
naming op, tag, group, peer ranks and step.
"""
from __future__ import annotations

import contextlib
import threading

import torch.distributed as dist

from .groups import group_name, group_ranks


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a dead or hung peer); ``str()`` is one line naming op,
    tag, group, peers and step. ``.op`` is the :func:`current_op` dict at the failure."""

    def __init__(self, msg: str, op: dict):
        super().__init__(msg)
        self.op = op


_CURRENT: tuple | None = None
_LOCAL = threading.local()
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
    return {"op": op, "tag": tag, "group": group_name(group), "ranks": group_ranks(group), "step": step}


def describe_op(op: dict) -> str:
    """One line for a :func:`current_op` dict: op, tag, group, ranks, step, and the peers that did
    not answer this rank."""
    me = dist.get_rank() if dist.is_initialized() else 0
    peers = [r for r in op["ranks"] if r != me]
    tag = f" (tag {op['tag']!r})" if op["tag"] else ""
    step = f" at step {op['step']}" if op["step"] is not None else ""
    return f"{op['op']}{tag} on group {op['group']} (ranks {op['ranks']}){step}: rank {me} got no answer " \
           f"from peer(s) {peers}"


@contextlib.contextmanager
def unwatched():
    """In this thread, for the block: collectives do not take the slot (:func:`current_op` keeps
    describing the training thread's collective); their failures are still re-raised as
    CollectiveError by :func:`watch` (a background checkpoint save's, handed to the training thread)."""
    prev, _LOCAL.off = getattr(_LOCAL, "off", False), True
    try:
        yield
    finally:
        _LOCAL.off = prev


@contextlib.contextmanager
def watch(op: str, group, tag: str = ""):
    """Record ``op`` as this rank's collective in progress while the block runs; re-raise its
    failure as a one-line CollectiveError. Inside :func:`unwatched` (a background checkpoint
    writer's thread, on groups of its own) the slot is left alone, and a failure is re-raised as
    CollectiveError all the same (it was gloo's bare RuntimeError there)."""
    global _CURRENT
    slot = (op, tag, group, _STEP)  # a tuple: no lookups per call
    mine = not getattr(_LOCAL, "off", False)
    if mine:
        saved, _CURRENT = _CURRENT, slot
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        info = _describe_slot(slot)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CollectiveError(f"{describe_op(info)} (dead or hung peer? {type(e).__name__}: {first})",
                              info) from e
    finally:
        if mine:
            _CURRENT = saved

