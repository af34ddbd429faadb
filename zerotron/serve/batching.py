"""Rank 0's batchers (the main thread: the only one running collectives), reading the
:class:`~zerotron.serve.api.Job` queue:

* :class:`WindowBatcher` (``--batching window``): the requests that arrive within
  ``--batch-window-ms`` of the first (up to ``--max-batch`` rows) form one batch, decoded to its
  end by ``Engine.generate`` (pipelines keep ``--microbatches`` micro-batches in flight); a request
  arriving meanwhile waits for the whole batch.
* :class:`ContinuousScheduler` (``--batching continuous``, the default): iteration-level batching
  (Orca, Yu et al. OSDI 2022; vLLM): before every decode iteration, waiting rows join (first come,
  first served, up to ``--max-batch`` rows running, each to the least-loaded dp replica), rows of
  cancelled jobs (the client disconnected) leave, and finished rows are answered as soon as they
  end. Keys and values live in a paged cache (``--kv-cache-mb``, ``--kv-page``); rows wait for
  blocks, and the newest is preempted (recomputed later) when the pool runs out. See
  :mod:`zerotron.inference.continuous`.

Both send every piece of collective work over the :class:`~zerotron.serve.follow.Channel` first,
and hand what a step decoded to ``front.publish`` once after it (the in-process
:class:`~zerotron.serve.api.Front` wakes the HTTP waiters; :class:`~zerotron.serve.link.RemoteFront`
sends it to the front-end process).
"""
from __future__ import annotations

import collections
import queue
import time

__all__ = ["WindowBatcher", "ContinuousScheduler"]

CANCELLED = "cancelled: the client disconnected"


def _refuse_rest(front) -> None:
    while not front.jobs.empty():  # enqueued while the drain began: refused, never left waiting
        front.jobs.get().finish("the server is shutting down")
    front.publish(())


class WindowBatcher:
    """``--batching window`` over ``engine`` (``front``: the job queue, draining flag, stats)."""

    def __init__(self, engine, front, channel, window_ms: float, max_batch: int):
        self.engine, self.front, self.channel = engine, front, channel
        self.window_s, self.max_batch = window_ms / 1e3, max_batch

    def run(self) -> None:
        jobs, stats = self.front.jobs, self.front.stats
        while True:
            try:
                job = jobs.get(timeout=1.0)
            except queue.Empty:
                if self.front.draining.is_set():
                    break
                self.channel.send({"kind": "idle"})
                continue
            batch, n = [job], len(job.requests)
            deadline = time.monotonic() + self.window_s
            while n < self.max_batch:
                try:
                    nxt = jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                batch.append(nxt)
                n += len(nxt.requests)
            reqs = [r for j in batch for r in j.requests]
            owner = [(j, k) for j in batch for k in range(len(j.requests))]
            stats.batches += 1
            self.channel.send({"kind": "batch", "requests": reqs})
            try:
                outs, err = self.engine.generate(reqs, on_token=lambda i, t: owner[i][0].token(owner[i][1], t)), None
            except Exception as e:  # noqa: BLE001 - answered as 500, the server goes on
                outs, err = None, f"{type(e).__name__}: {e}"
            for j in batch:
                if outs is not None:
                    j.result, outs = outs[:len(j.requests)], outs[len(j.requests):]
                stats.requests += 1
                j.finish(err)
            self.front.publish(batch)
        self.channel.send({"kind": "stop"})
        _refuse_rest(self.front)


class ContinuousScheduler:
    """``--batching continuous`` over ``engine`` (see the module docstring)."""

    def __init__(self, engine, front, channel, max_batch: int, paged: dict | None = None):
        from zerotron.inference.continuous import ContinuousDecoder

        self.engine, self.front, self.channel, self.max_batch = engine, front, channel, max_batch
        self.paged = paged or {}  # ContinuousDecoder options: the followers get the same
        self.decoder = ContinuousDecoder(engine, **self.paged)
        self.preempt_base = self.hit_base = self.miss_base = self.prop_base = self.acc_base = 0  # replaced decoders
        self._account()
        self.waiting: collections.deque = collections.deque()  # (job, row of the job)
        self.live: dict = {}  # row id -> (job, row of the job)
        self.next_id = 0

    def _take(self, block: bool) -> bool:
        """Move arrived jobs to ``waiting`` (waiting up to 1 s for one if ``block``); False if none."""
        got = False
        while True:
            try:
                job = self.front.jobs.get(timeout=1.0) if block and not got else self.front.jobs.get_nowait()
            except queue.Empty:
                return got
            self.waiting.extend((job, k) for k in range(len(job.requests)))
            got = True

    def _cancelled(self) -> list[int]:
        """Row ids of cancelled jobs to drop from the batch; cancelled jobs' waiting rows are
        forgotten and the jobs finished."""
        cancel = [rid for rid, (j, _) in self.live.items() if j.cancelled.is_set()]
        gone = {j for j, _ in self.waiting if j.cancelled.is_set()} | {self.live[r][0] for r in cancel}
        self.waiting = collections.deque((j, k) for j, k in self.waiting if not j.cancelled.is_set())
        for r in cancel:
            del self.live[r]
        for j in gone:
            j.finish(CANCELLED)
        self.front.stats.cancelled_rows += len(cancel)
        return cancel

    def _joins(self) -> list:
        joins, load = [], self.decoder.replica_load()
        while self.waiting and len(self.live) < self.max_batch:
            j, k = self.waiting.popleft()
            rep = min(range(len(load)), key=lambda r: (load[r], r))
            load[rep] += 1
            joins.append((self.next_id, rep, j.requests[k]))
            self.live[self.next_id] = (j, k)
            self.next_id += 1
        return joins

    def _fail_all(self, err: str) -> None:
        from zerotron.inference.continuous import ContinuousDecoder

        for j in {j for j, _ in self.live.values()}:
            j.finish(err)
        self.live.clear()
        self.decoder = ContinuousDecoder(self.engine, **self.paged)

    def _account(self) -> None:
        """The paged cache's figures into the front's stats (``/metrics``)."""
        d, s = self.decoder, self.front.stats
        s.kv_blocks_used, s.kv_blocks_free = d.blocks_used(), d.blocks_free()
        s.kv_slots_allocated, s.kv_slots_filled = s.kv_blocks_used * d.page, d.slots_filled()
        s.preemptions = self.preempt_base + d.preemptions
        s.prefix_hits = self.hit_base + sum(a.hits for a in d.alloc)
        s.prefix_misses = self.miss_base + sum(a.misses for a in d.alloc)
        s.spec_proposed, s.spec_accepted = self.prop_base + d.proposed, self.acc_base + d.accepted

    def run(self) -> None:
        stats = self.front.stats
        while True:
            idle = not self.waiting and not self.live
            if not self._take(block=idle) and idle:
                if self.front.draining.is_set():
                    break
                self.channel.send({"kind": "idle"})
                continue
            cancel = self._cancelled()
            joins = self._joins()
            if not joins and not cancel and not self.live:
                continue
            stats.steps += 1
            stats.batches += bool(joins)
            self.channel.send({"kind": "step", "join": joins, "cancel": cancel})
            try:
                res = self.decoder.step(joins, cancel)
            except Exception as e:  # noqa: BLE001 - the rows' jobs answer 500; the followers reset alike
                s = self.front.stats
                self.preempt_base, self.hit_base, self.miss_base = s.preemptions, s.prefix_hits, s.prefix_misses
                self.prop_base, self.acc_base = s.spec_proposed, s.spec_accepted
                self._fail_all(f"{type(e).__name__}: {e}")
                self._account()
                self.front.publish(())
                continue
            touched = {}
            for rid, toks in res.tokens.items():
                j, k = self.live[rid]
                touched[j] = None
                for tok in toks:
                    j.token(k, tok, wake=False)
            for rid, new in res.finished.items():
                j, k = self.live.pop(rid)
                j.result[k] = new
                j.pending -= 1
                if j.pending == 0:
                    stats.requests += 1
                    j.finish()
            stats.running = len(self.live)
            self._account()
            self.front.publish(touched)  # one wake-up (or message) per step, not one per token
        self.channel.send({"kind": "stop"})
        _refuse_rest(self.front)
