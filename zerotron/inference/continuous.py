"""Continuous (iteration-level) batching: :class:`ContinuousDecoder`.

Orca (Yu et al., OSDI 2022) and vLLM schedule per decoding *iteration* instead of per batch: between
two decode steps finished rows leave and waiting requests join, so a request that arrives while
others are decoding starts at the next step instead of waiting for the whole batch to finish.

:meth:`ContinuousDecoder.step` is one iteration, collective over the whole mesh (every rank calls
it with the same ``joins`` and ``cancel``, which rank 0's scheduler decides and broadcasts):

1. cancelled rows leave (their cache rows are dropped: they consume no more decode steps);
2. the rows already running on this rank's dp replica take one decode step (their last token with
   the KV cache; past ``block_size`` the cache is rebuilt from the last block_size tokens of every
   row, as in :mod:`zerotron.inference.batch`);
3. the rows joining this replica are prefilled together (left-padded among themselves, their
   prompts cropped to the last block_size tokens) and sample their first token; their keys and
   values are copied into the running batch's :class:`~zerotron.inference.kvcache.PooledKVCache`
   after the running rows (right-aligned at the common last slot, per-row left padding, so the
   positions ``slot - pad`` stay each row's own; the running rows are not copied);
4. the sampled tokens are all-gathered over the world, so every rank knows every row's tokens and
   ends rows identically (eos, max_tokens, stop strings: the same rule as
   :class:`~zerotron.inference.batch.DecodeBatch`); finished rows leave the cache (rows from the
   end fill their places; when the common slot reaches block_size, the slots that are padding in
   every row are dropped first).

Layouts: the same as :class:`~zerotron.inference.Engine` (single process, tp, dp, pp, any product):
rows are assigned to a dp replica by the scheduler; tp ranks decode the same rows on their head
shards (logits gathered by the model's hooks, identical generators, so identical tokens); with pp
the iteration walks the stages (stage s receives the activations of the span before it, the last
stage samples), one stage busy at a time: micro-batches in flight are a feature of the window
batcher's :class:`~zerotron.inference.pipelined.PipelinedDecoder`, not of continuous batching.

A row computes what it would alone (greedy: equal to ``Engine.generate`` of the request alone, in
fp64; sampling: each row has its own generator seeded with its ``params.seed``, one draw per step),
whoever shares its batch and whenever it joined.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerotron.distributed import comm

from .batch import PAD_ID, Request, is_eos
from .forward import forward_layers
from .kvcache import PooledKVCache, StaticKVCache
from .sampling import make_generator, sample_rows

__all__ = ["ContinuousDecoder", "StepResult"]


@dataclass
class _Row:
    request: Request
    replica: int
    tokens: list[int]
    new: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass
class StepResult:
    """One iteration's outcome, identical on every rank: ``tokens`` {row id: its new token};
    ``finished`` {row id: all its new tokens} for the rows that ended (eos, max_tokens, stop
    string, or a max_tokens of 0 at join) and left the batch; cancelled rows appear in neither."""

    tokens: dict[int, int]
    finished: dict[int, list[int]]


class ContinuousDecoder:
    """Iteration-level batching over ``engine``'s model and mesh (an :class:`~zerotron.inference.Engine`;
    its tensor-parallel model or pipeline stage, ``eos_id`` and ``decode`` are reused). Keeps every
    running row's tokens (on every rank) and this rank's replica's KV cache."""

    def __init__(self, engine):
        self.engine, self.mesh = engine, engine.mesh
        self.cfg, self.device = engine.config, engine.device
        self.replica = self.mesh.local_rank("dp")
        pl = engine.pipeline
        if pl is None:
            self.blocks, self.layers = engine.model.blocks(), list(range(self.cfg.n_layer))
            self.first = self.last = True
        else:
            self.blocks, self.layers, self.first, self.last = pl.blocks, pl.layers, pl.first, pl.last
        self.pl = pl
        self.sampler = self.last and self.mesh.local_rank("tp") == 0  # reports this replica's tokens
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.rows: dict[int, _Row] = {}
        self.order: list[int] = []  # this replica's rows, in cache order
        self.cache = PooledKVCache(self.cfg.n_layer, self.cfg.block_size)
        self.steps = 0

    @property
    def running(self) -> int:
        """Rows running on every replica together."""
        return len(self.rows)

    def replica_load(self) -> list[int]:
        """Running rows per dp replica."""
        load = [0] * self.mesh.size("dp")
        for r in self.rows.values():
            load[r.replica] += 1
        return load

    # ---- one iteration --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, joins: list[tuple[int, int, Request]], cancel: list[int]) -> StepResult:
        """One iteration (collective over the mesh; every rank passes the same arguments): rows
        ``cancel`` leave, the running rows decode one token, ``joins`` = [(row id, dp replica,
        request)] are prefilled and sample their first token. Raises ValueError (before any
        collective) for a row id already running, a replica out of range, an empty prompt,
        invalid sampling parameters, or stop strings without the engine's ``decode``."""
        for rid, rep, req in joins:
            req.params.validate()
            if rid in self.rows or not 0 <= rep < self.mesh.size("dp") or not req.prompt:
                raise ValueError(f"bad join: row {rid} (running: {rid in self.rows}), replica {rep}, "
                                 f"prompt of {len(req.prompt)} tokens")
            if req.params.stop and self.engine.decode is None:
                raise ValueError("requests with stop strings need an Engine built with decode= (the tokenizer)")
        self.steps += 1
        self._leave([r for r in cancel if r in self.rows])
        finished: dict[int, list[int]] = {}
        newcomers = []
        for rid, rep, req in joins:
            if req.params.max_tokens == 0:
                finished[rid] = []
                continue
            self.rows[rid] = _Row(req, rep, list(req.prompt), generator=make_generator(req.params.seed, self.device))
            if rep == self.replica:
                newcomers.append(rid)
        mine: dict[int, int] = {}
        with self.engine.model.parallel_hooks.generation():
            if self.order:
                mine.update(self._decode())
            if newcomers:
                mine.update(self._prefill(newcomers))
        self.order += newcomers
        tokens: dict[int, int] = {}
        parts = comm.all_gather_object(mine if self.sampler else {}) if self.world > 1 else [mine]
        for part in parts:
            tokens.update(part)
        done = []
        for rid, tok in tokens.items():
            row = self.rows[rid]
            row.tokens.append(tok)
            row.new.append(tok)
            if self._ends(row, tok):
                done.append(rid)
                finished[rid] = row.new
        self._leave(done)
        return StepResult(tokens, finished)

    def _ends(self, row: _Row, tok: int) -> bool:
        p = row.request.params
        if len(row.new) >= p.max_tokens or (p.stop_at_eos and is_eos(tok, self.engine.eos_id)):
            return True
        return bool(p.stop) and any(s in self.engine.decode(row.new) for s in p.stop)

    def _leave(self, rids: list[int]) -> None:
        gone = set(rids)
        if not gone:
            return
        drop = [i for i, r in enumerate(self.order) if r in gone]
        if drop:
            self.order = [self.order[i] for i in self.cache.remove(drop)]
        for r in gone:
            self.rows.pop(r, None)

    def _decode(self) -> dict[int, int]:
        c, bs = self.cache, self.cfg.block_size
        if c.S + 1 > bs:
            c.trim()  # slots that became padding in every row (their rows left)
        if c.S + 1 <= bs:
            x = torch.tensor([[self.rows[r].tokens[-1]] for r in self.order], device=self.device)
            logits = self._forward(x, c)
        else:  # the context is full: rebuild from the last block_size tokens of every row
            x, pad = self._padded(self.order)
            fresh = StaticKVCache(self.cfg.n_layer, pad, x.size(1))
            logits = self._forward(x, fresh)
            c.remove(list(range(c.B)))
            c.append(fresh)
        return self._sample(self.order, logits)

    def _prefill(self, rids: list[int]) -> dict[int, int]:
        x, pad = self._padded(rids)
        fresh = StaticKVCache(self.cfg.n_layer, pad, x.size(1))
        logits = self._forward(x, fresh)
        out = self._sample(rids, logits)
        self.cache.append(fresh)  # the newcomers' rows after the running ones (self.order += rids)
        return out

    def _padded(self, rids) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.rows[r].tokens[-self.cfg.block_size:] for r in rids]
        L = max(len(r) for r in rows)
        idx = torch.tensor([[PAD_ID] * (L - len(r)) + r for r in rows], device=self.device)
        return idx, torch.tensor([L - len(r) for r in rows], device=self.device)

    def _forward(self, x: torch.Tensor, cache) -> torch.Tensor | None:
        """This rank's span of the model on x: token ids (b, T) on the first stage, else the
        previous stage's activations (b, T, C), received here; returns logits (b, V) on the last
        stage, else sends the activations on and returns None."""
        pl = self.pl
        if not self.first:
            buf = torch.empty(x.size(0), x.size(1), pl.width, dtype=pl.act_dtype, device=self.device)
            comm.recv(buf, pl.prev, group=pl.group, tag="decode")
            x = buf
        y = forward_layers(self.engine.model, self.blocks, self.layers, x, cache, self.first, self.last)
        if isinstance(cache, PooledKVCache):
            cache.commit(x.size(1))
        if not self.last:
            comm.send(y.to(pl.act_dtype).contiguous(), pl.next, group=pl.group, tag="decode")
            return None
        return y

    def _sample(self, rids, logits) -> dict[int, int]:
        if not self.last:
            return {}
        rows = [self.rows[r] for r in rids]
        toks = sample_rows(logits, [r.request.params for r in rows], [r.generator for r in rows]).tolist()
        return dict(zip(rids, toks))
