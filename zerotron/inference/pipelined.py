"""Pipelined decoding with micro-batches in flight: :class:`PipelinedDecoder`.

The model's layers are split over the pp stages as in training (``PipelineStrategy``: balanced
blocks, embedding on stage 0, head on the last stage, the other stages' weight storage freed).
Each stage keeps the KV cache of *its* layers, one cache per micro-batch.

Stage 0 is the controller. It starts every micro-batch (prefill), then loops: take the oldest
micro-batch in flight, receive its sampled tokens from the last stage, and unless it is finished
run its next token through stage 0 and send it on. A decode step is ONE message downstream: a
flat buffer ``[micro-batch, kind, activation (b, 1, C)]`` (sized for the largest micro-batch;
kind 0 = decode, 1 = (re)prefill, 2 = stop); a (re)prefill adds ``[T, pad (b,)]`` int64 and the
activation (b, T, C); the last stage samples (per-request generators, as everywhere) and sends the tokens
(b,) back to stage 0. Receives are posted before the data is due (stage 0 posts a micro-batch's
token receive as it launches it; the other stages post the next header's receive before computing
the current one), and each micro-batch reuses its own message buffer, so a step allocates nothing
for communication and a send never waits for the receiver to get ready. With m micro-batches and p stages, micro-batch j's next step can start as
soon as its token is back, so after the warm-up every stage works on a different micro-batch when
m >= p (Huang et al. 2019's micro-batching applied to decoding); with m = 1 the one batch walks
the stages and only one stage is busy at a time (naive model parallelism). Sends are
asynchronous and waited when their buffer is reused or at the end, so the ring cannot deadlock.

Throughput bound: a micro-batch's next step needs its previous token, so one cycle of the ring
takes at least C_0(b) + ... + C_{p-1}(b) + p message latencies (C_s(b): stage s's step on b rows),
and at least m * max_s C_s(b) when the stages are the bottleneck. With m = p = 2 and balanced
stages the ring is the bound, so pipelining gains C(B)/C(B/2) over naive model parallelism (B
rows in the batch) when each stage has its own core, and loses where the two ranks share one core
(pp then does 2 C(B/2) > C(B) work per token). The fixed cost of a step, streaming the stage's
weights, is why C(B/2) is well above C(B)/2 on a small model.

With tensor parallelism inside the stages, each tp rank talks to the same tp rank of the
neighbouring stage (the activations are full and identical across tp).
"""
from __future__ import annotations

import collections
import time

import torch

from zerotron.distributed import comm
from zerotron.parallel.pipeline.runner import PipelineStrategy
from zerotron.plan import ParallelPlan

from .batch import DecodeBatch
from .forward import RunStats, forward_layers

__all__ = ["PipelinedDecoder", "split_microbatches", "decode_split"]


def decode_split(n_layer: int, pp: int, width: int, vocab: int) -> str:
    """A ``parallel.pp_split`` balancing decode-time cost: each block costs ~12 C^2 multiply-adds
    per token (attention q/k/v/o 4 C^2, MLP 8 C^2), the last stage's head C V more, i.e.
    V / (12 C) blocks. Returns the split (comma-separated layer counts, each >= 1) minimising the
    largest stage cost; earlier stages take the extra layers on ties."""
    head = vocab / (12 * width)
    best = None

    def walk(prefix, left, stages):
        nonlocal best
        if stages == 1:
            counts = prefix + [left]
            cost = max(counts[:-1] + [counts[-1] + head])
            if best is None or cost < best[0] - 1e-9:
                best = (cost, counts)
            return
        for c in range(left - stages + 1, 0, -1):
            walk(prefix + [c], left - c, stages - 1)
    walk([], n_layer, pp)
    return ",".join(map(str, best[1]))


def split_microbatches(n: int, m: int) -> list[range]:
    """Rows 0..n-1 split into min(m, n) contiguous near-equal micro-batches (earlier ones larger)."""
    m = max(1, min(m, n))
    sizes = [n // m + (1 if j < n % m else 0) for j in range(m)]
    out, lo = [], 0
    for s in sizes:
        out.append(range(lo, lo + s))
        lo += s
    return out


class PipelinedDecoder:
    """This rank's pipeline stage of ``model`` (dense or tensor-parallel, identical on the pp ranks)
    over ``mesh``'s pp group; ``pp_split``: layers per stage ("3,1"; "" = equal counts; "auto" balances
    training FLOPs as ``parallel.pp_split = auto`` does). ``stage``: the StageModel holding this rank's modules. Raises ValueError for a bad split."""

    def __init__(self, model, mesh, pp_split: str = ""):
        self.strategy = PipelineStrategy(model, mesh, ParallelPlan(mesh.dims, pp_split=pp_split))
        self.stage, self.model, self.mesh = self.strategy.module, model, mesh
        self.pp, self.rank = mesh.size("pp"), mesh.local_rank("pp")
        self.first, self.last = self.rank == 0, self.rank == self.pp - 1
        self.layers = list(self.stage.layer_ranges[self.rank])
        blocks = self.stage.blocks_here
        self.blocks = {i: blocks[str(i)] for i in self.layers}
        self.prev = self.strategy._peer(self.rank - 1) if not self.first else None
        self.next = self.strategy._peer(self.rank + 1) if not self.last else None
        self.head_rank, self.tail_rank = self.strategy._peer(0), self.strategy._peer(self.pp - 1)
        self.group, self.width = mesh.group("pp"), model.layout().width
        self.act_dtype = next(iter(self.stage.parameters())).dtype
        self._sends: dict = {}  # slot -> [(works, tensor)] posted and not yet waited

    def _send(self, t: torch.Tensor, dst: int, slot=None) -> None:
        """Post an asynchronous send of ``t`` (contiguous; kept alive until it completes). ``slot``
        (a micro-batch's send buffer): first wait for that slot's previous send, which the ring has
        already delivered (the micro-batch came back before it is sent again), so the wait is free."""
        if slot is not None:
            self._wait_slot(slot)
        works = [comm.isend(t, dst, group=self.group, tag="decode")]
        self._sends.setdefault(slot, []).append((works, t))

    def _wait_slot(self, slot) -> None:
        for works, _ in self._sends.pop(slot, ()):
            for w in works:
                w.wait()

    def _irecv(self, buf: torch.Tensor, src: int) -> list:
        """Post a receive into ``buf`` now (before the peer sends: the data lands without a
        rendezvous round trip); wait on the returned handles before reading ``buf``."""
        return [comm.irecv(buf, src, group=self.group, tag="decode")]

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.stage_device)
        for w in self._irecv(buf, src):
            w.wait()
        return buf

    @property
    def stage_device(self) -> torch.device:
        return next(iter(self.stage.parameters())).device

    def run(self, requests, index, microbatches: int, eos_id, stats: RunStats, t0: float, decode=None,
            on_token=None) -> list[list[int]]:
        """Decode ``requests`` (identical on every rank of the pipeline) in ``microbatches``
        micro-batches (requests sorted by prompt length, then split into near-equal runs); returns every request's new tokens on every pp rank (broadcast from stage 0).
        ``decode`` / ``on_token``: as in :class:`DecodeBatch` (on_token is called on stage 0 and
        the last stage, which both advance the batches). Adds to ``stats`` (busy time, TTFT, step
        times, KV bytes)."""
        cfg, dev = self.model.config, self.stage_device
        # micro-batches of similar prompt lengths: each is left-padded only to its own longest prompt
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt))
        parts = [[order[k] for k in r] for r in split_microbatches(len(requests), microbatches)]
        batches = [DecodeBatch([requests[i] for i in p], [index[i] for i in p], cfg.n_layer, cfg.block_size,
                               eos_id, dev, decode, on_token) for p in parts]
        self.max_b = max(len(p) for p in parts)
        if self.first:
            self._controller(batches, stats, t0)
        else:
            self._follower(batches, stats, t0)
        for slot in list(self._sends):
            self._wait_slot(slot)
        out: list = [None] * len(requests)
        for p, b in zip(parts, batches):
            for i, new in zip(p, b.new):
                out[i] = new
        if self.pp > 1 and not (self.first and self.last):
            out = comm.broadcast_object(out if self.first else None, src=self.head_rank, group=self.group)
        stats.new_tokens += sum(len(n) for n in out) if self.last else 0
        return out

    def _compute(self, batch: DecodeBatch, x: torch.Tensor, pad, stats: RunStats) -> torch.Tensor:
        tb = time.perf_counter()
        cache = batch.start(pad, x.size(1))
        y = forward_layers(self.model, self.blocks, self.layers, x, cache, self.first, self.last)
        stats.busy_s += time.perf_counter() - tb
        if pad is not None:  # a (re)prefill allocated this batch's cache: the peak can only change here
            stats.kv_cache_bytes = max(stats.kv_cache_bytes, sum(b.kv_bytes() for b in self._batches))
        return y

    def _msg_buf(self, j: int) -> torch.Tensor:
        """Micro-batch j's reusable downstream message buffer ``[j, kind, activation]``."""
        buf = self._msgs.get(j)
        if buf is None:
            buf = self._msgs[j] = torch.zeros(2 + self.max_b * self.width, dtype=self.act_dtype, device=self.stage_device)
            buf[0] = j
        return buf

    def _forward_msg(self, j: int, y: torch.Tensor, pad) -> None:
        """Send micro-batch j's stage output y (b, T, C) downstream (see the module docstring)."""
        self._wait_slot(("down", j))  # delivered already (see _send): the buffer can be rewritten
        msg = self._msg_buf(j)
        msg[1] = 0 if pad is None else 1
        if pad is None:
            msg[2:2 + y.numel()].copy_(y.reshape(-1))
            self._send(msg, self.next, ("down", j))
            return
        self._send(msg, self.next, ("down", j))
        self._send(torch.cat([torch.tensor([y.size(1)], device=pad.device), pad]), self.next, ("down", j))
        self._send(y.to(self.act_dtype).contiguous(), self.next, ("down", j))

    def _stop_msg(self) -> None:
        msg = torch.zeros(2 + self.max_b * self.width, dtype=self.act_dtype, device=self.stage_device)
        msg[1] = 2
        self._send(msg, self.next, "stop")

    def _launch(self, j: int, batch: DecodeBatch, stats: RunStats) -> None:
        """Stage 0: run micro-batch j's next input through this stage, send it downstream and post
        the receive of its sampled tokens (they come back in launch order: every stage is FIFO)."""
        idx, pad = batch.next_input()
        y = self._compute(batch, idx, pad, stats)
        self._forward_msg(j, y.to(self.act_dtype), pad)
        buf = self._tok_bufs.get(j)
        if buf is None:
            buf = self._tok_bufs[j] = torch.empty(batch.size, dtype=torch.long, device=self.stage_device)
        self._tok_recv[j] = (self._irecv(buf, self.tail_rank), buf)

    def _controller(self, batches, stats: RunStats, t0: float) -> None:
        self._batches, self._msgs, self._tok_bufs, self._tok_recv = batches, {}, {}, {}
        inflight = collections.deque()
        last_t = [None] * len(batches)
        for j, b in enumerate(batches):
            if not b.finished:
                self._launch(j, b, stats)
                inflight.append(j)
        while inflight:
            j = inflight.popleft()
            b = batches[j]
            works, tok = self._tok_recv.pop(j)
            for w in works:
                w.wait()
            b.advance(tok)
            now = time.perf_counter()
            if stats.first_token_s is None:
                stats.first_token_s = now - t0
            if last_t[j] is not None:
                stats.step_s.append(now - last_t[j])
            last_t[j] = now
            if not b.finished:
                self._launch(j, b, stats)
                inflight.append(j)
        self._stop_msg()

    def _follower(self, batches, stats: RunStats, t0: float) -> None:
        """Every stage but the first: the next header's receive is posted before this micro-batch
        is computed (two alternating buffers), so the upstream send never waits for this stage."""
        self._batches, self._msgs = batches, {}
        n = 2 + self.max_b * self.width
        bufs = [torch.empty(n, dtype=self.act_dtype, device=self.stage_device) for _ in range(2)]
        k = 0
        pending = self._irecv(bufs[0], self.prev)
        while True:
            for w in pending:
                w.wait()
            msg = bufs[k % 2]
            j, kind = (int(v) for v in msg[:2].tolist())
            if kind == 2:
                if not self.last:
                    self._stop_msg()
                return
            b = batches[j]
            pad = None
            if kind == 1:  # its pad and activation follow the header: receive them before posting the next header
                tp = self._recv((b.size + 1,), torch.long, self.prev)
                pad = tp[1:]
                x = self._recv((b.size, int(tp[0]), self.width), self.act_dtype, self.prev)
            else:
                x = msg[2:2 + b.size * self.width].view(b.size, 1, self.width)
            k += 1
            pending = self._irecv(bufs[k % 2], self.prev)
            y = self._compute(b, x, pad, stats)
            if self.last:
                tb = time.perf_counter()
                tok = b.sample(y)
                self._send(tok, self.head_rank, ("up", j))  # first: stage 0 waits for it
                b.advance(tok)  # the bookkeeping (and stop strings) overlaps stage 0's next step
                stats.busy_s += time.perf_counter() - tb
            else:
                self._forward_msg(j, y, pad)
