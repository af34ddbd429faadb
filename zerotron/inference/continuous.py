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
from zerotron.host_heap import physical_bytes

from .batch import Request, is_eos
from .continuous_compute import ContinuousCompute
from .continuous_schedule import ContinuousSchedule, Row
from .paged import BlockAllocator, BlockPool
from .prefix_attention import attention_modules
from .sampling import make_generator

__all__ = ["ContinuousDecoder", "StepResult", "DEFAULT_PAGE", "DEFAULT_ROWS", "DEFAULT_STEP_TOKENS", "kv_block_bytes",
           "rank_memory_bytes"]

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


def rank_memory_bytes(device) -> int:
    """The memory a KV pool on ``device`` can at most take: a CUDA device's total memory, else the
    host's physical memory shared by its local ranks (``LOCAL_WORLD_SIZE``, 1 when unset); 0 when
    unknown (no check)."""
    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return physical_bytes() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


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


class ContinuousDecoder(ContinuousSchedule, ContinuousCompute):
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
    the pool cannot hold one full-context row (``ceil(block_size / page)`` blocks).

    The rows' bookkeeping and each step's schedule are its :class:`~zerotron.inference.continuous_schedule.ContinuousSchedule`
    part, the forwards and sampling its :class:`~zerotron.inference.continuous_compute.ContinuousCompute` part."""

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
        need, room = num_blocks * kv_block_bytes(engine, page), rank_memory_bytes(self.device)
        if room and need > room:  # before the bookkeeping: its lists alone grow with num_blocks
            raise ValueError(f"the KV pool of {num_blocks:,} blocks of {page:,} slots needs {need / 2**30:,.3g} GiB per "
                             f"rank, more than this rank's {room / 2**30:,.3g} GiB of memory: give less KV cache memory "
                             "or a smaller page")
        self.page, self.num_blocks, self.max_step_tokens = page, num_blocks, max_step_tokens
        self.alloc = [BlockAllocator(num_blocks, page, prefix_caching) for _ in range(self.engine.replicas)]
        self.pool = BlockPool(self.cfg.n_layer, num_blocks, page)
        self.rows: dict[int, Row] = {}
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
            self.rows[rid] = Row(req, rep, list(req.prompt), generator=make_generator(req.params.seed, self.device))
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

    def _ends(self, row: Row, tok: int) -> bool:
        p = row.request.params
        if len(row.new) >= p.max_tokens or (p.stop_at_eos and is_eos(tok, self.engine.eos_id)):
            return True
        return bool(p.stop) and any(s in self.engine.decode(row.new) for s in p.stop)
