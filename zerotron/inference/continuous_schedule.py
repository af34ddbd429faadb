"""The schedule of :class:`~zerotron.inference.continuous.ContinuousDecoder`: its rows
(:class:`Row`), their blocks and the pool's counts, and each iteration's decision -- which rows
decode, which prefill how many tokens, which are preempted, which fork from a leader -- made the
same on every rank (the policy: :mod:`zerotron.inference.continuous`, step 2). A mixin: the decoder
sets ``rows``, ``order``, ``waiting``, ``alloc``, ``cfg``, ``page``, ``engine``, ``max_step_tokens``,
``speculative``, ``draft_model``, ``drafts`` and the counters it updates."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .batch import PAD_ID, Request
from .speculative import ngram_propose


@dataclass
class Row:
    """One request in the decoder: its dp ``replica``, all its ``tokens`` (prompt + generated), the
    ``new`` ones, its sampling generator, its block ``table`` and prefix keys."""

    request: Request
    replica: int
    tokens: list[int]
    new: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    table: list[int] = field(default_factory=list)  # block ids of the slots tokens[base:]
    base: int = 0  # the cache holds tokens[base:] (> 0 once the context passed block_size)
    cached: int = 0  # slots written
    keys: list[int] = field(default_factory=list)  # prefix keys of the full blocks of tokens[keys_base:]
    keys_base: int = 0
    prompt_keys: list[int] = field(default_factory=list)  # prefix keys of the full blocks it prefills (admission)


class ContinuousSchedule:
    """Block bookkeeping and scheduling of every replica's rows (deterministic: the same on every
    rank); mixed into :class:`~zerotron.inference.continuous.ContinuousDecoder`."""

    # ---- the pool's counts -------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Rows on every replica together (running or waiting for blocks)."""
        return len(self.rows)

    def replica_load(self) -> list[int]:
        """Rows (running or waiting) per dp replica."""
        load = [0] * self.engine.replicas
        for r in self.rows.values():
            load[r.replica] += 1
        return load

    def blocks_used(self) -> int:
        """KV blocks referenced by rows, all replicas together."""
        return sum(a.used for a in self.alloc)

    def slots_filled(self) -> int:
        """Slots holding a cached token in the KV blocks rows reference, all replicas; a block
        shared by several rows (prefix cache, forks) is counted once, with its fullest row's
        fill. ``1 - slots_filled() / (blocks_used() * page)`` is the pool's waste (vLLM's measure:
        reserved but unwritten slots, Kwon et al. 2023 section 2.3): partly filled last blocks,
        blocks reserved for a prompt whose chunked prefill is not done, speculative slots.

        O(rows), not O(blocks): every block a row references is full but those from its slot
        ``cached`` on (its last, partly filled block and blocks reserved ahead), so the figure is
        ``blocks_used() * page`` less the empty slots of those; a block shared by several rows has
        the same fill in each (only full blocks enter the prefix cache; a fork's shared last block
        is copied before either row writes it), so it is counted once."""
        p = self.page
        short: dict[tuple[int, int], int] = {}  # (replica, block) -> its empty slots
        for r in self.rows.values():
            for i in range(r.cached // p, len(r.table)):
                short[(r.replica, r.table[i])] = p - max(0, r.cached - i * p)
        return self.blocks_used() * p - sum(short.values())

    def blocks_free(self) -> int:
        """KV blocks not referenced (free, or holding evictable cached prefixes), all replicas."""
        return sum(a.available for a in self.alloc)

    def _leave(self, rids: list[int]) -> None:
        gone = set(rids)
        for r in gone:
            row = self.rows.pop(r, None)
            if row is not None:
                self.alloc[row.replica].release(row.table)
        self.order = [r for r in self.order if r not in gone]
        self.waiting = [r for r in self.waiting if r not in gone]

    # ---- scheduling (deterministic: the same on every rank) --------------------------------------------
    def _preempt(self, rid: int) -> None:
        row = self.rows[rid]
        self.alloc[row.replica].release(row.table)
        self.recomputed_tokens += row.cached
        row.table, row.cached = [], 0
        self.order.remove(rid)
        self.waiting.insert(0, rid)
        self.preemptions += 1

    def _schedule(self):
        """Decide this iteration: (decoding rows, [(row, tokens to prefill)], {fork: its leader},
        block copies (replica, src, dst) to make first, preempted rows). Budget per dp replica:
        decoding rows first, then the next chunks of rows part-way through their prefill, then
        newcomers (first come, first served)."""
        bs, p = self.cfg.block_size, self.page
        decode, fills, preempted, copies = [], [], [], []
        budget = [self.max_step_tokens] * len(self.alloc)
        for rid in list(self.order):  # oldest first: the newest is preempted when blocks run out
            if rid not in self.order:
                continue  # preempted for an older row
            row = self.rows[rid]
            a = self.alloc[row.replica]
            if len(row.tokens) - row.base > bs:  # the context is full: recompute the last block_size tokens
                a.release(row.table)
                row.table, row.cached, row.base = [], 0, len(row.tokens) - bs
                self.order.remove(rid)
                self.waiting.insert(0, rid)
                continue
            s = row.cached
            if len(row.tokens) - row.base - s > 1:
                continue  # part-way through its prefill: its blocks are held, its chunk comes below
            cow = s % p != 0 and a.refs[row.table[s // p]] > 1
            if self.speculative:  # proposals that fit the context, the row's max_tokens and free blocks
                room = min(self.speculative, bs - s - 1, row.request.params.max_tokens - len(row.new) - 1)
                d = ngram_propose(row.tokens, room) if self.draft_model is None else [PAD_ID] * max(room, 0)
                extra = math.ceil((s + 1 + len(d)) / p) - len(row.table) - (s % p == 0)
                if d and extra + (s % p == 0) + cow <= a.available:
                    self.drafts[rid] = d
                    row.table += [a.allocate() for _ in range(extra)]
            need = s % p == 0 or cow
            while need and a.available < 1:
                victim = [r for r in self.order if self.rows[r].replica == row.replica][-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim == rid:
                    break
            if rid not in self.order:
                continue
            if need:
                b = a.allocate()
                if s % p:  # copy-on-write of the shared, partly filled block of slot s
                    i = s // p
                    copies.append((row.replica, row.table[i], b))
                    a.release([row.table[i]])
                    row.table[i] = b
                else:
                    row.table.insert(s // p, b)
            decode.append(rid)
            budget[row.replica] -= 1 + len(self.drafts.get(rid, ()))
        for rid in self.order:  # chunked prefill (split-fuse): the next chunk of each started prompt
            row = self.rows[rid]
            pending = len(row.tokens) - row.base - row.cached
            if pending > 1 and rid not in decode and budget[row.replica] > 0:
                n = min(pending, budget[row.replica])
                fills.append((rid, n))
                budget[row.replica] -= n
        forks: dict[int, int] = {}
        leaders: dict[tuple, int] = {}
        blocked: set[int] = set()  # replicas whose queue head does not fit: later rows wait behind it
        pending = [set() for _ in self.alloc]  # per replica: keys of prompt blocks being prefilled, not yet cached
        for rid in self.order:
            row = self.rows[rid]
            if row.prompt_keys and len(row.tokens) - row.base - row.cached > 1:
                pending[row.replica].update(row.prompt_keys[row.cached // p:])
        for rid in list(self.waiting):
            row = self.rows[rid]
            if row.replica in blocked:
                continue
            a = self.alloc[row.replica]
            if len(row.tokens) - row.base > bs:
                row.base = len(row.tokens) - bs
            seq = row.tokens[row.base:]
            key = (row.replica, tuple(seq))
            if key in leaders:
                forks[rid] = leaders[key]
                self.waiting.remove(rid)
                self.order.append(rid)
                continue
            total = math.ceil(len(seq) / p)
            keys = a.prefix_keys(seq, len(seq) - 1)
            hit = a.match(seq, len(seq) - 1, keys)
            shared_soon = len(hit) < len(keys) and keys[len(hit)] in pending[row.replica]
            if total - len(hit) > a.available or budget[row.replica] < 1 or shared_soon:
                a.release(hit)  # not admitted now: the lookup is counted when the row is
                a.hits -= len(hit)
                a.misses -= (len(seq) - 1) // p - len(hit) if a.prefix_caching else 0
                blocked.add(row.replica)
                continue
            row.table = hit + [a.allocate() for _ in range(total - len(hit))]
            row.cached = len(hit) * p
            row.prompt_keys = keys
            pending[row.replica].update(keys[len(hit):])
            n = min(len(seq) - row.cached, budget[row.replica])
            budget[row.replica] -= n
            if n == len(seq) - row.cached:
                leaders[key] = rid  # rows with this prompt behind it share its blocks
            self.waiting.remove(rid)
            self.order.append(rid)
            fills.append((rid, n))
        return decode, fills, forks, copies, preempted

    def _advance(self, rid: int, n: int) -> None:
        """After the forward: ``n`` more slots of the row are written; full blocks get their
        prefix keys."""
        row = self.rows[rid]
        if row.keys_base != row.base:  # the context moved: the cached prefix keys are another sequence's
            row.keys, row.keys_base = [], row.base
        start = row.cached
        row.cached += n
        self.alloc[row.replica].register(row.table, row.tokens, start, row.cached, row.keys, row.base)
