"""The rank-follow protocol of ``zerotron serve``: rank 0 decides, every other rank follows.

Rank 0's batcher broadcasts one message (``broadcast_object`` from rank 0 over the world) before
each piece of collective work, and every rank then does that work together:

* ``{"kind": "batch", "requests": [...]}`` (window batching): every rank runs
  ``Engine.generate(requests)``;
* ``{"kind": "step", "join": [(row id, dp replica, request)], "cancel": [row ids]}`` (continuous
  batching): every rank runs one ``ContinuousDecoder.step(join, cancel)`` iteration;
* ``{"kind": "idle"}``: a heartbeat, about once a second while nothing runs, so the other ranks
  never hit the collective timeout;
* ``{"kind": "stop"}``: the server drained; every rank leaves.

A failure inside the work (rank 0 answers 500) is met the same way on every rank: the continuous
decoder is replaced by a fresh one (its rows are dropped), so the ranks stay in step.
"""
from __future__ import annotations

__all__ = ["Channel", "follow"]


class Channel:
    """Rank 0's end of the protocol: :meth:`send` broadcasts a message (a no-op in one process)."""

    def __init__(self, world: int):
        self.world = world

    def send(self, msg: dict) -> None:
        if self.world > 1:
            from zerotron.distributed import comm

            comm.broadcast_object(msg, src=0)


def follow(engine, paged: dict | None = None) -> None:
    """Every rank but 0: receive rank 0's messages and do the work they name, until ``stop``.
    ``paged``: the ``ContinuousDecoder`` options (pool size, page, prefix caching, step budget),
    the same as rank 0's."""
    from zerotron.distributed import comm
    from zerotron.inference.continuous import ContinuousDecoder

    decoder = None
    while True:
        msg = comm.broadcast_object(None, src=0)
        kind = msg["kind"]
        if kind == "stop":
            return
        if kind == "batch":
            try:
                engine.generate(msg["requests"])
            except Exception:  # noqa: BLE001 - rank 0 fails the same way and answers 500
                pass
        elif kind == "step":
            decoder = decoder or ContinuousDecoder(engine, **(paged or {}))
            try:
                decoder.step(msg["join"], msg["cancel"])
            except Exception:  # noqa: BLE001 - as on rank 0: the rows are dropped, a fresh decoder
                decoder = ContinuousDecoder(engine, **(paged or {}))
