"""Posting one rank's SEND/RECV runs of a pipeline walk, with early receives and timing.

The executor (``pipeline.executor.PipelineExecutor``) meets a *comm run* (a maximal run of
consecutive SEND/RECV actions, ``pipeline.schedules``) between two compute groups. Posting each run
as one ``batch_isend_irecv`` and receiving only when the compute that needs the tensor is next
(the schedule's literal order) puts a p2p round trip on the critical path: gloo's TCP transport
moves a message only once both sides have posted it (the receiver announces its buffer, then the
sender's background thread writes), so a receive posted just before its compute waits for a
notification, a wake-up of the sender's I/O thread and the copy, even when the sender had posted
its send long before. On a shared CPU each wake-up can cost a scheduler slice (milliseconds).

:class:`CommRunPoster` posts instead, when it reaches run k, the sends of run k, every receive of
run k not yet posted, and (``prefetch``) the receives of run k + 1 -- one compute group ahead, so
the data flows while this rank computes, and the wait before the compute usually finds it there.
Receives are still posted in schedule order per peer (only earlier), sends exactly where the
schedule has them, and each receive is still waited for before the compute that reads it, so the
order-based matching and the deadlock freedom argued in ``pipeline.schedules`` are unchanged: an
early ``irecv`` never blocks. Prefetch costs one more activation-sized buffer per direction in
flight. On gloo the ops are posted one by one (``comm.isend``/``comm.irecv``, no coalescing set-up
per run); on other backends (NCCL), where a lone p2p op can block its stream, each run stays ONE
``comm.batch_isend_irecv`` and nothing is prefetched (the previous behaviour).

Timing (seconds, accumulated until :meth:`reset`): ``post_s`` (inside the posting calls; its
``post_cpu_s`` part is this thread's CPU time, the rest is the thread being descheduled: each
message wakes the peer's gloo I/O thread, and on a loaded machine the poster often loses its core
then -- measured: about one involuntary context switch per isend under load),
``recv_wait_s`` (waiting for a run's receives), ``send_wait_s`` (waiting for sends at the end of a
walk). ``events`` keeps, per message, ``("S", walk, key, t_issue)`` (just before the send call)
and ``("R", walk, key,
t_wait_start, t_wait_end)``, and the executor adds one ``("C", walk, (kind, microbatch, model stage),
t_start, t_end)`` per compute (``time.perf_counter``, CLOCK_MONOTONIC: comparable between processes
on one host; ``key`` = ``schedules.message_key``), from which :func:`~zerotron.parallel.pipeline.
accounting.recv_wait_split` tells a receive's wait for its sender (dependency: the bubble the
simulator predicts) from its wait after the send was posted (transfer latency: executor overhead).
"""
from __future__ import annotations

import time

import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.parallel.pipeline.schedules import COMM, Action, message_key

__all__ = ["comm_runs", "CommRunPoster"]


def comm_runs(actions: list[Action]) -> list[tuple[int, int]]:
    """[start, end) index ranges of the maximal runs of consecutive SEND/RECV actions, in order."""
    runs, i, n = [], 0, len(actions)
    while i < n:
        if actions[i].kind in COMM:
            j = i
            while j < n and actions[j].kind in COMM:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


class CommRunPoster:
    """Posts and waits one rank's comm runs (see the module docstring).

    ``group``: the pp ``comm.NamedGroup``; ``peer_rank(pp index) -> global rank``; ``rank``/``place``:
    this rank's pp index and the pipeline's ``zerotron.stages.Placement`` (for the message keys of the
    events); ``prefetch``: post the next run's
    receives early (default: on when the backend is gloo); ``batched``: one ``batch_isend_irecv``
    per run (default: on unless gloo). Receive buffers are allocated by ``alloc(action)`` (the
    executor's pre-agreed activation shape, so no shape handshake)."""

    def __init__(self, group, peer_rank, rank: int, place, prefetch: bool | None = None,
                 batched: bool | None = None):
        pp = place.pp
        gloo = pp > 1 and dist.is_initialized() and dist.get_backend(getattr(group, "pg", group)) == "gloo"
        self.group, self.peer_rank, self.rank, self.pp, self.place = group, peer_rank, rank, pp, place
        self.batched = (not gloo) if batched is None else batched
        self.prefetch = (gloo and not self.batched) if prefetch is None else (prefetch and not self.batched)
        self.reset()

    def reset(self) -> None:
        """Zero the timers and drop the events."""
        self.post_s = self.post_cpu_s = self.recv_wait_s = self.send_wait_s = 0.0
        self.events: list[tuple] = []
        self.walks = 0

    def start_walk(self, actions: list[Action], alloc) -> None:
        """Begin a walk of ``actions``: remember its comm runs; nothing is posted yet."""
        runs = comm_runs(actions)
        self._runs = {i: (i, j) for i, j in runs}
        self._next = {runs[k][0]: runs[k + 1] for k in range(len(runs) - 1)}
        self._actions, self._alloc = actions, alloc
        self._posted: dict = {}    # action index -> (Work, buffer) of a posted receive
        self.sending: list = []    # (Work, tensor) of posted sends, waited for in finish_walk
        self.walks += 1

    def _recv(self, idx: int) -> None:
        a = self._actions[idx]
        buf = self._alloc(a)
        w = comm.irecv(buf, self.peer_rank(a.peer), group=self.group, tag="pp")
        self._posted[idx] = (w, buf)

    def run(self, start: int, outgoing: dict) -> dict:
        """Post and wait the comm run starting at action ``start``: ``outgoing[idx]`` is the tensor of
        each SEND at index idx. Returns {action index: received tensor} of the run's RECVs (all
        complete). Raises what ``Work.wait`` raises (e.g. a peer's timeout)."""
        i, j = self._runs[start]
        acts, walk, now = self._actions, self.walks, time.perf_counter
        t0, c0 = now(), time.thread_time()
        self.sending = [x for x in self.sending if not x[0].is_completed()]
        recvs = [k for k in range(i, j) if acts[k].kind.startswith("RECV")]
        if self.batched:
            ops, bufs = [], {}
            for k in range(i, j):
                a = acts[k]
                if a.kind.startswith("SEND"):
                    ops.append(("send", outgoing[k], self.peer_rank(a.peer)))
                else:
                    bufs[k] = self._alloc(a)
                    ops.append(("recv", bufs[k], self.peer_rank(a.peer)))
            t_post = now()  # the sends' issue time
            works = comm.batch_isend_irecv(ops, group=self.group, tag="pp")
            for k, w in zip(range(i, j), works):
                if acts[k].kind.startswith("SEND"):
                    self.sending.append((w, outgoing[k]))
                    self.events.append(("S", walk, message_key(acts[k], self.rank, self.place), t_post))
                else:
                    self._posted[k] = (w, bufs[k])
        else:
            for k in range(i, j):
                a = acts[k]
                if a.kind.startswith("SEND"):
                    t = outgoing[k]
                    self.events.append(("S", walk, message_key(a, self.rank, self.place), now()))  # issued
                    self.sending.append((comm.isend(t, self.peer_rank(a.peer), group=self.group, tag="pp"), t))
            for k in recvs:
                if k not in self._posted:
                    self._recv(k)
            if self.prefetch:
                ni, nj = self._next.get(i, (0, 0))
                for k in range(ni, nj):
                    if acts[k].kind.startswith("RECV") and k not in self._posted:
                        self._recv(k)
        t1 = now()
        self.post_s += t1 - t0
        self.post_cpu_s += time.thread_time() - c0
        got = {}
        for k in recvs:
            w, buf = self._posted.pop(k)
            tw = now()
            w.wait()
            self.events.append(("R", walk, message_key(acts[k], self.rank, self.place), tw, now()))
            got[k] = buf
        self.recv_wait_s += now() - t1
        return got

    def finish_walk(self) -> None:
        """Wait for every send of the walk. Raises RuntimeError if a receive was posted but never
        reached (a malformed schedule)."""
        t0 = time.perf_counter()
        for w, _ in self.sending:
            w.wait()
        self.sending = []
        self.send_wait_s += time.perf_counter() - t0
        if self._posted:
            raise RuntimeError("pipeline walk ended with receives posted but not reached: malformed schedule")
