"""Continuous (iteration-level) batching over a paged KV cache: :class:`ContinuousDecoder`.

Orca (Yu et al., OSDI 2022) and vLLM schedule per decoding *iteration* instead of per batch: between
two decode steps finished rows leave and waiting requests join, so a request that arrives while
others are decoding starts at the next step instead of waiting for the whole batch to finish.

Keys and values live in a paged cache (:mod:`zerotron.inference.paged`, PagedAttention, Kwon et al.
SOSP 2023): one pool of ``num_blocks`` blocks of ``page`` slots per layer on this rank (its pipeline
stage's layers, its tensor-parallel kv heads, its dp replica's rows), a block table per row, prefix
blocks shared by hash, copy-on-write for rows forked from one prompt (``n > 1``).

:meth:`ContinuousDecoder.step` is one iteration, collective over the whole mesh (every rank calls
it with the same ``joins`` and ``cancel``, which rank 0's scheduler decides and broadcasts; the
block bookkeeping of every replica is kept, identically, on every rank):

1. cancelled rows leave (their blocks are released);
2. *schedule* (per dp replica): each running row, oldest first, gets the block its next slot needs
   (a fresh one at a block boundary, a private copy of a shared last block); when the pool has none
   left the newest running row is *preempted* (its blocks freed, its tokens kept: it waits at the
   head of the queue and is recomputed when blocks are free again); then waiting rows are admitted
   first come, first served, while their blocks fit and the step's token budget
   (``max_step_tokens``: one per decoding row, the uncached prompt tokens of each newcomer; the
   first newcomer of a step is always admitted when its blocks fit) lasts; the queue's head is
   never overtaken, so every row runs once the rows before it are done (no starvation); a
   newcomer whose next uncached prompt block is being prefilled by a running row (the same
   tokens after the same prefix: a shared system prompt arriving with many requests at once)
   waits, and the rows behind it with it, until that block is written and cached, then reuses it
   (SGLang's in-batch prefix caching): it prefills its own tokens only and shares the prefix's
   blocks with the others, instead of computing and holding a private copy;
3. the running rows decode one token (their last token through the cache); rows whose context
   reached ``block_size`` are recomputed from their last block_size tokens, as in
   :mod:`zerotron.inference.batch`;
4. admitted rows are prefilled together (only the tokens after their longest cached prefix; rows
   with a prompt equal to an earlier newcomer's share its blocks) and sample their first token;
5. the sampled tokens are all-gathered over the world, so every rank knows every row's tokens and
   ends rows identically (eos, max_tokens, stop strings: the same rule as
   :class:`~zerotron.inference.batch.DecodeBatch`).

Layouts: the same as :class:`~zerotron.inference.Engine` (single process, tp, dp, pp, any product):
rows are assigned to a replica (dp, or dp / ep under expert parallelism: the ep ranks of a replica decode the same rows, each with its E/ep experts) by the scheduler; tp ranks decode the same rows on their head
shards (logits gathered by the model's hooks, identical generators, so identical tokens); with pp
the iteration walks the stages (stage s receives the activations of the span before it, the last
stage samples), one stage busy at a time.

A row computes what it would alone (greedy: equal to ``Engine.generate`` of the request alone, in
fp64; sampling: each row has its own generator seeded with its ``params.seed``, one draw per
sampled token), whoever shares its batch, whenever it joined, however often it was preempted.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from zerotron.distributed import comm

from .batch import PAD_ID, Request, is_eos
from .forward import forward_layers
from .paged import BlockAllocator, BlockPool, PagedView
from .prefix_attention import attention_modules, shared_prefix_hooks
from .sampling import make_generator, sample_rows
from .speculative import accept_drafts, ngram_propose

__all__ = ["ContinuousDecoder", "StepResult", "DEFAULT_PAGE", "DEFAULT_ROWS", "DEFAULT_STEP_TOKENS", "kv_block_bytes",
           "memory_bytes"]

DEFAULT_PAGE = 8  # slots per KV block: the waste is ~(page - 1) / 2 slots per row (vLLM's default is 16:
# 5.5 % waste at 64 rows of 16..128 + 128 tokens, 2.7 % with 8; the gather reads slot by slot, so pages cost
# only bookkeeping: benchmarks/kv_waste_pages.py)
DEFAULT_ROWS = 32  # the default pool holds this many full-context rows
DEFAULT_STEP_TOKENS = 2048  # the default token budget of one iteration


def kv_block_bytes(engine, page: int) -> int:
    """Bytes of one KV block of ``page`` slots on the rank of ``engine``'s mesh that holds the
    most: keys and values of its pipeline stage's layers (the largest stage), its share of the kv
    heads (ceil(H_kv / tp)), ``head_dim`` each, in the model's dtype. Every rank computes the same
    figure (the block count must agree on every rank)."""
    cfg = engine.config
    pl = engine.pipeline
    layers = max(len(r) for r in pl.stage.layer_ranges) if pl is not None else cfg.n_layer
    heads = math.ceil(getattr(cfg, "n_kv_head", cfg.n_head) / engine.tp)
    elem = next(iter(engine.model.parameters())).element_size()
    return 2 * page * layers * heads * (cfg.n_embd // cfg.n_head) * elem


def memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` in bytes: a CUDA device's (``total_memory``), else this host's
    physical memory (``sysconf``: SC_PHYS_PAGES x SC_PAGE_SIZE; a cgroup limit is not read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _Row:
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


@dataclass
class StepResult:
    """One iteration's outcome, identical on every rank: ``tokens`` {row id: its new tokens (one,
    or with speculative decoding up to k + 1)};
    ``finished`` {row id: all its new tokens} for the rows that ended (eos, max_tokens, stop
    string, or a max_tokens of 0 at join) and left the batch; cancelled rows appear in neither;
    ``preempted``: row ids preempted in this step (they get tokens again once recomputed)."""

    tokens: dict[int, list[int]]
    finished: dict[int, list[int]]
    preempted: list[int] = field(default_factory=list)


class ContinuousDecoder:
    """Iteration-level batching over ``engine``'s model and mesh (an :class:`~zerotron.inference.Engine`;
    its tensor-parallel model or pipeline stage, ``eos_id`` and ``decode`` are reused), on a paged
    KV cache of ``num_blocks`` blocks of ``page`` slots per layer and dp replica (None:
    :data:`DEFAULT_ROWS` full-context rows); ``prefix_caching``: reuse cached prefix blocks;
    ``max_step_tokens``: the token budget of one iteration; ``speculative``: k tokens proposed per
    decoding row by prompt lookup (:mod:`zerotron.inference.speculative`; 0: off) or, given a
    ``draft_model`` (a dense ``CausalLM`` with the same vocabulary, in eval mode, on every rank),
    by its greedy continuation (run by the row's replica only: the bookkeeping needs only the
    count, which is fixed). ``shared_prefix``: the rows of a forward that all start with the same
    cached blocks attend to them once (:mod:`zerotron.inference.prefix_attention`; False: every
    row reads its whole context through its own gather). ``compile``: decode forwards without a
    shared prefix or speculation run as one compiled graph
    (:class:`~zerotron.inference.paged_compiled.CompiledPagedDecode`, compiled here, before the
    first step; single process and data parallel only, else ValueError with the reason). Keeps every row's tokens and every
    replica's block bookkeeping (on every rank) and this rank's blocks. Raises ValueError when
    the pool cannot hold one full-context row (``ceil(block_size / page)`` blocks)."""

    def __init__(self, engine, num_blocks: int | None = None, page: int = DEFAULT_PAGE,
                 prefix_caching: bool = True, max_step_tokens: int = DEFAULT_STEP_TOKENS, speculative: int = 0,
                 draft_model=None, shared_prefix: bool = True, compile: bool = False):
        self.engine, self.mesh = engine, engine.mesh
        self.cfg, self.device = engine.config, engine.device
        self.replica = engine.replica
        pl = engine.pipeline
        if pl is None:
            self.blocks, self.layers = engine.model.blocks(), list(range(self.cfg.n_layer))
            self.first = self.last = True
        else:
            self.blocks, self.layers, self.first, self.last = pl.blocks, pl.layers, pl.first, pl.last
        self.pl = pl
        self.shared_prefix = shared_prefix
        self.attn_modules = attention_modules(engine.model, self.blocks, self.layers) if shared_prefix else []
        self.prefix_forwards = 0  # forwards that attended to a shared prefix once
        # reports this replica's tokens (with ep split by replica, its first ep rank; split by tokens, every rank)
        self.sampler = self.last and self.mesh.local_rank("tp") == 0 and (engine.ep_rank == 0 or engine.lockstep is not None)
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        per_row = math.ceil(self.cfg.block_size / page) if page >= 1 else 0
        num_blocks = DEFAULT_ROWS * per_row if num_blocks is None else num_blocks
        if page < 1 or num_blocks < per_row or max_step_tokens < 1:
            raise ValueError(f"the KV pool of {num_blocks} blocks of {page} slots cannot hold one full-context row "
                             f"(block_size {self.cfg.block_size} needs {per_row} blocks; max_step_tokens "
                             f"{max_step_tokens}): give more KV cache memory or a smaller page")
        pool, have = num_blocks * kv_block_bytes(engine, page), memory_bytes(self.device)
        if pool > have:  # checked before the allocator's tables: --kv-cache-mb 1e8 was killed by the OOM killer
            # at start, without a word; --kv-page 1e9 served, and every request failed allocating 62 TB
            raise ValueError(f"the KV pool of {num_blocks:,} blocks of {page:,} slots needs {pool / 2**30:,.1f} GiB on "
                             f"the fullest rank, more than the {have / 2**30:,.1f} GiB of memory of its device "
                             f"({self.device.type}): give less KV cache memory or a smaller page")
        self.page, self.num_blocks, self.max_step_tokens = page, num_blocks, max_step_tokens
        self.alloc = [BlockAllocator(num_blocks, page, prefix_caching) for _ in range(self.engine.replicas)]
        self.pool = BlockPool(self.cfg.n_layer, num_blocks, page)
        self.rows: dict[int, _Row] = {}
        self.order: list[int] = []  # running rows (every replica), oldest first
        self.waiting: list[int] = []  # admitted by the scheduler, not running (preempted ones first)
        self.steps = self.preemptions = self.recomputed_tokens = 0
        if speculative < 0:
            raise ValueError(f"speculative must be >= 0 tokens, got {speculative}")
        self.speculative, self.draft_model = speculative, draft_model
        if draft_model is not None and draft_model.config.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) differs from the "
                             f"target's ({self.cfg.vocab_size}): use a draft trained with the same tokenizer")
        self.drafts: dict[int, list[int]] = {}  # this step's proposals per decoding row
        self.compiled = None  # the compiled decode forward (compile=True)
        if compile:
            from .compiled import compile_refusal
            from .paged_compiled import CompiledPagedDecode

            reason = compile_refusal(engine.tp, engine.pp, engine.ep)
            if reason:
                raise ValueError(reason)
            self.compiled = CompiledPagedDecode(engine.model, attention_modules(engine.model, self.blocks, self.layers),
                                                self.pool)
            dtype = next(iter(engine.model.parameters())).dtype
            self.compiled.warm_up(getattr(self.cfg, "n_kv_head", self.cfg.n_head), self.cfg.n_embd // self.cfg.n_head,
                                  dtype, self.device)
        self.proposed = self.accepted = 0  # draft tokens proposed / accepted

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

    # ---- one iteration --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, joins: list[tuple[int, int, Request]], cancel: list[int]) -> StepResult:
        """One iteration (collective over the mesh; every rank passes the same arguments): rows
        ``cancel`` leave, the running rows decode one token, ``joins`` = [(row id, dp replica,
        request)] queue up and are admitted (prefilled, first token sampled) as blocks and the
        token budget allow. Raises ValueError (before any collective) for a row id already known,
        a replica out of range, an empty prompt, invalid sampling parameters, or stop strings
        without the engine's ``decode``."""
        for rid, rep, req in joins:
            req.params.validate()
            if rid in self.rows or not 0 <= rep < self.engine.replicas or not req.prompt:
                raise ValueError(f"bad join: row {rid} (known: {rid in self.rows}), replica {rep}, "
                                 f"prompt of {len(req.prompt)} tokens")
            if req.params.stop and self.engine.decode is None:
                raise ValueError("requests with stop strings need an Engine built with decode= (the tokenizer)")
        self.steps += 1
        self._leave([r for r in cancel if r in self.rows])
        finished: dict[int, list[int]] = {}
        for rid, rep, req in joins:
            if req.params.max_tokens == 0:
                finished[rid] = []
                continue
            self.rows[rid] = _Row(req, rep, list(req.prompt), generator=make_generator(req.params.seed, self.device))
            self.waiting.append(rid)
        decode, fills, forks, copies, preempted = self._schedule()  # copies: (replica, src, dst)
        mine: dict[int, list[int]] = {}
        with self.engine.model.parallel_hooks.generation():
            for rep, src, dst in copies:
                if rep == self.replica:
                    self.pool.copy_block(src, dst)
            own = [r for r in decode if self.rows[r].replica == self.replica]
            if own:
                mine.update(self._decode(own))
            own = [(r, n) for r, n in fills if self.rows[r].replica == self.replica]
            if own:
                mine.update(self._prefill(own, forks))
            if self.engine.lockstep is not None:
                self._idle_forwards(decode, fills)
        for rid, n in fills:
            self._advance(rid, n)
        for fork, lead in forks.items():
            f, lr = self.rows[fork], self.rows[lead]
            f.table, f.base, f.cached = [self.alloc[f.replica].share(b) for b in lr.table], lr.base, lr.cached
        tokens: dict[int, list[int]] = {}
        parts = comm.all_gather_object(mine if self.sampler else {}) if self.world > 1 else [mine]
        for part in parts:
            tokens.update(part)
        done = []
        for rid, toks in tokens.items():
            row = self.rows[rid]
            drafts = self.drafts.pop(rid, [])
            self.proposed += len(drafts)
            self.accepted += len(toks) - 1
            for k, tok in enumerate(toks):
                row.tokens.append(tok)
                row.new.append(tok)
                if self._ends(row, tok):
                    del toks[k + 1:]  # accepted drafts after the end are dropped
                    done.append(rid)
                    finished[rid] = row.new
                    break
            if rid in decode and rid not in finished:  # the last token and the accepted drafts are cached
                self._advance(rid, len(toks))
                a, keep = self.alloc[row.replica], math.ceil(row.cached / self.page)
                a.release(row.table[keep:])  # blocks of rejected drafts
                del row.table[keep:]
        self._leave(done)
        return StepResult(tokens, finished, preempted)

    def _idle_forwards(self, decode: list[int], fills: list) -> None:
        """Token-split ep (``Engine(ep_split="tokens")``): as many empty forwards as this rank's ep
        peers run more forwards than it in this step (a decode and a prefill forward per replica
        with such rows; the schedule is known on every rank, so no collective decides it)."""
        eng = self.engine
        base = self.replica - eng.ep_rank  # the ep group's replicas: base .. base + ep - 1
        runs = [0] * eng.ep
        for rows in (decode, [r for r, _ in fills]):
            for rep in {self.rows[r].replica for r in rows}:
                if base <= rep < base + eng.ep:
                    runs[rep - base] += 1
        for _ in range(max(runs) - runs[eng.ep_rank]):
            eng.lockstep.idle_forward()

    def _ends(self, row: _Row, tok: int) -> bool:
        p = row.request.params
        if len(row.new) >= p.max_tokens or (p.stop_at_eos and is_eos(tok, self.engine.eos_id)):
            return True
        return bool(p.stop) and any(s in self.engine.decode(row.new) for s in p.stop)

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

    # ---- compute (this rank's replica only) -------------------------------------------------------------
    def _decode(self, rids: list[int]) -> dict[int, list[int]]:
        """One decoding step of ``rids``: each row's last token (and its draft tokens, verified)."""
        rows = [self.rows[r] for r in rids]
        drafts = [self.drafts.get(r, []) for r in rids]
        if self.draft_model is not None:  # the counts were fixed by the schedule; the draft fills them in
            for rid, r, d in zip(rids, rows, drafts):
                if d:
                    ctx = torch.tensor([r.tokens], device=self.device)
                    d[:] = self.draft_model.generate(ctx, len(d), temperature=0)[0, -len(d):].tolist()
        news = [1 + len(d) for d in drafts]
        T = max(news)
        if T == 1 and self.compiled is not None and not self._may_share(rows):  # one compiled call
            logits = self.compiled([r.tokens[-1] for r in rows], [r.table for r in rows], [r.cached for r in rows])
            return {r: [t] for r, t in self._sample(rids, logits).items()}
        x = torch.tensor([[PAD_ID] * (T - n) + [r.tokens[-1]] + d for r, d, n in zip(rows, drafts, news)],
                         device=self.device)
        view = PagedView(self.pool, [r.table for r in rows], [r.cached for r in rows], news, self.device,
                         self.shared_prefix)
        if T == 1:  # (compiled: only rows that share a prefix come here; their attention reads it once, eagerly)
            return {r: [t] for r, t in self._sample(rids, self._forward(x, view)).items()}
        logits = self._forward(x, view, all_logits=True)
        if logits is None:
            return {}
        return {rid: accept_drafts(logits[b, T - n:], d, r.request.params, r.generator)
                for b, (rid, r, d, n) in enumerate(zip(rids, rows, drafts, news))}

    def _may_share(self, rows: list[_Row]) -> bool:
        """Whether the rows of a forward may start with shared cached blocks (shared-prefix
        attention on, several rows, each with a full cached block, all with the same first
        block): only then does :class:`~zerotron.inference.paged.PagedView` look for a prefix."""
        if not self.shared_prefix or len(rows) < 2 or min(r.cached for r in rows) < self.page:
            return False
        first = rows[0].table[0]
        return all(r.table[0] == first for r in rows)

    def _prefill(self, fills: list[tuple[int, int]], forks: dict[int, int]) -> dict[int, int]:
        """Prefill chunks ``fills`` = [(row, tokens)] together; the rows whose prompt is then
        complete (and their forks) sample their first token."""
        rids = [r for r, _ in fills]
        rows = [self.rows[r] for r in rids]
        news = [n for _, n in fills]
        T = max(news)
        x = []
        for r, n in zip(rows, news):
            lo = r.base + r.cached
            x.append([PAD_ID] * (T - n) + r.tokens[lo:lo + n])
        view = PagedView(self.pool, [r.table for r in rows], [r.cached for r in rows], news, self.device,
                         self.shared_prefix)
        logits = self._forward(torch.tensor(x, device=self.device), view)
        if logits is None:
            return {}
        at = {r: i for i, (r, row, n) in enumerate(zip(rids, rows, news))
              if row.cached + n == len(row.tokens) - row.base}
        fk = [f for f, lead in forks.items() if lead in at]
        keep = list(at) + fk
        out = self._sample(keep, logits[[at[r] for r in at] + [at[forks[f]] for f in fk]])
        return {r: [t] for r, t in out.items()}

    def _forward(self, x: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor | None:
        """This rank's span of the model on x: token ids (b, T) on the first stage, else the
        previous stage's activations (b, T, C), received here; returns logits (b, V) on the last
        stage, else sends the activations on and returns None."""
        pl = self.pl
        if not self.first:
            buf = torch.empty(x.size(0), x.size(1), pl.width, dtype=pl.act_dtype, device=self.device)
            comm.recv(buf, pl.prev, group=pl.group, tag="decode")
            x = buf
        self.prefix_forwards += bool(cache.prefix_blocks)
        with shared_prefix_hooks(self.attn_modules, cache):
            y = forward_layers(self.engine.model, self.blocks, self.layers, x, cache, self.first, self.last, all_logits)
        if not self.last:
            comm.send(y.to(pl.act_dtype).contiguous(), pl.next, group=pl.group, tag="decode")
            return None
        return y

    def _sample(self, rids, logits) -> dict[int, int]:
        if not self.last or logits is None:
            return {}
        rows = [self.rows[r] for r in rids]
        toks = sample_rows(logits, [r.request.params for r in rows], [r.generator for r in rows]).tolist()
        return dict(zip(rids, toks))
