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
(b,) back to stage 0. With m micro-batches and p stages, micro-batch j's next step can start as
soon as its token is back, so after the warm-up every stage works on a different micro-batch when
m >= p (Huang et al. 2019's micro-batching applied to decoding); with m = 1 the one batch walks
the stages and only one stage is busy at a time (naive model parallelism). Sends are
asynchronous and waited at the end, receives block, so the ring cannot deadlock.

With tensor parallelism inside the stages, each tp rank talks to the same tp rank of the
neighbouring stage (the activations are full and identical across tp).
"""
from __future__ import annotations

import collections
import time

import torch

from zerotron.config import Config
from zerotron.distributed import comm
from zerotron.parallel.pipeline.runner import PipelineStrategy

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
        cfg = Config()
        cfg.parallel.pp_split = pp_split
        self.strategy = PipelineStrategy(model, mesh, cfg)
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
        self._sends: list = []

    def _send(self, t: torch.Tensor, dst: int) -> None:
        """Post an asynchronous send of ``t`` (kept alive until it completes)."""
        t = t.contiguous()
        if len(self._sends) >= 64:  # drop the completed ones (their buffers may be freed)
            self._sends = [(ws, b) for ws, b in self._sends if not all(w.is_completed() for w in ws)]
        self._sends.append((comm.batch_isend_irecv([("send", t, dst)], group=self.group, tag="decode"), t))

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.stage_device)
        for w in comm.batch_isend_irecv([("recv", buf, src)], group=self.group, tag="decode"):
            w.wait()
        return buf

    @property
    def stage_device(self) -> torch.device:
        return next(iter(self.stage.parameters())).device

    def run(self, requests, index, microbatches: int, eos_id, stats: RunStats, t0: float) -> list[list[int]]:
        """Decode ``requests`` (identical on every rank of the pipeline) in ``microbatches``
        micro-batches; returns every request's new tokens on every pp rank (broadcast from stage 0).
        Adds to ``stats`` (busy time, TTFT, step times, KV bytes)."""
        cfg, dev = self.model.config, self.stage_device
        parts = split_microbatches(len(requests), microbatches)
        batches = [DecodeBatch([requests[i] for i in p], [index[i] for i in p], cfg.n_layer, cfg.block_size,
                               eos_id, dev) for p in parts]
        self.max_b = max(len(p) for p in parts)
        if self.first:
            self._controller(batches, stats, t0)
        else:
            self._follower(batches, stats, t0)
        for ws, _ in self._sends:
            for w in ws:
                w.wait()
        self._sends.clear()
        out = [new for b in batches for new in b.new]
        if self.pp > 1 and not (self.first and self.last):
            out = comm.broadcast_object(out if self.first else None, src=self.head_rank, group=self.group)
        stats.new_tokens += sum(len(n) for n in out) if self.last else 0
        return out

    def _compute(self, batch: DecodeBatch, x: torch.Tensor, pad, stats: RunStats) -> torch.Tensor:
        tb = time.perf_counter()
        cache = batch.start(pad)
        y = forward_layers(self.model, self.blocks, self.layers, x, cache, self.first, self.last)
        stats.busy_s += time.perf_counter() - tb
        stats.kv_cache_bytes = max(stats.kv_cache_bytes, sum(b.kv_bytes() for b in self._batches))
        return y

    def _forward_msg(self, j: int, y: torch.Tensor, pad) -> None:
        """Send micro-batch j's stage output y (b, T, C) downstream (see the module docstring)."""
        msg = torch.zeros(2 + self.max_b * self.width, dtype=self.act_dtype, device=y.device)
        msg[0], msg[1] = j, 0 if pad is None else 1
        if pad is None:
            msg[2:2 + y.numel()] = y.reshape(-1)
            self._send(msg, self.next)
            return
        self._send(msg, self.next)
        self._send(torch.cat([torch.tensor([y.size(1)], device=pad.device), pad]), self.next)
        self._send(y.to(self.act_dtype), self.next)

    def _stop_msg(self) -> None:
        msg = torch.zeros(2 + self.max_b * self.width, dtype=self.act_dtype, device=self.stage_device)
        msg[1] = 2
        self._send(msg, self.next)

    def _launch(self, j: int, batch: DecodeBatch, stats: RunStats) -> None:
        """Stage 0: run micro-batch j's next input through this stage and send it downstream."""
        idx, pad = batch.next_input()
        y = self._compute(batch, idx, pad, stats)
        self._forward_msg(j, y.to(self.act_dtype), pad)

    def _controller(self, batches, stats: RunStats, t0: float) -> None:
        self._batches = batches
        inflight = collections.deque()
        last_t = [None] * len(batches)
        for j, b in enumerate(batches):
            if not b.finished:
                self._launch(j, b, stats)
                inflight.append(j)
        while inflight:
            j = inflight.popleft()
            b = batches[j]
            tok = self._recv((b.size,), torch.long, self.tail_rank)
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
        self._batches = batches
        n = 2 + self.max_b * self.width
        while True:
            msg = self._recv((n,), self.act_dtype, self.prev)
            j, kind = int(msg[0]), int(msg[1])
            if kind == 2:
                if not self.last:
                    self._stop_msg()
                return
            b = batches[j]
            pad = None
            if kind == 1:
                tp = self._recv((b.size + 1,), torch.long, self.prev)
                pad = tp[1:]
                x = self._recv((b.size, int(tp[0]), self.width), self.act_dtype, self.prev)
            else:
                x = msg[2:2 + b.size * self.width].view(b.size, 1, self.width)
            y = self._compute(b, x, pad, stats)
            if self.last:
                tb = time.perf_counter()
                tok = b.sample(y)
                b.advance(tok)
                stats.busy_s += time.perf_counter() - tb
                self._send(tok, self.head_rank)
            else:
                self._forward_msg(j, y, pad)
