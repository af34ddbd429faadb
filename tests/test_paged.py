"""The paged KV cache (zerotron.inference.paged) under continuous batching: the allocator's free
list, reference counts, prefix keys and LRU eviction; 16 concurrent requests of mixed lengths
(shared prefixes, forks of one prompt, contexts past block_size) through a pool too small for all
of them, with a token budget that chunks prefills, give every request exactly the tokens it gets
alone (greedy and sampled, fp64, GPT-2 and Llama), with preemptions, prefix hits and
copy-on-write copies counted. Multi-process layouts: tests/test_continuous.py."""
import dataclasses

import pytest
import torch
from test_inference import VOCAB, _local_engine, _model

from zerotron.inference.batch import Request
from zerotron.inference.continuous import ContinuousDecoder
from zerotron.inference.paged import BlockAllocator, OutOfBlocks, PagedView
from zerotron.inference.sampling import SamplingParams


def test_allocator_free_list_refs_prefix_and_lru():
    a = BlockAllocator(4, 2)
    t = [a.allocate(), a.allocate()]
    assert t == [0, 1] and a.used == 2 and a.available == 2
    a.register(t, [5, 6, 7, 8], 0, 4)  # both blocks full: keyed
    a.release(t)
    assert a.used == 0 and list(a.lru) == [1, 0] and list(a.free) == [2, 3]  # tail released first
    hit = a.match([5, 6, 7, 8, 9], 4)
    assert hit == [0, 1] and a.hits == 2 and a.refs[0] == 1 and not a.lru
    assert a.match([5, 6, 1, 1], 4) == [0] and (a.hits, a.misses) == (3, 1)  # second block differs
    assert a.match([1, 6, 7, 8], 4) == [] and a.misses == 3  # same block, another prefix: no hit
    a.release([0])
    a.release(hit)
    x = [a.allocate(), a.allocate(), a.allocate()]  # free ones first, then the LRU cached one
    assert x == [2, 3, 1] and a.evictions == 1 and a.match([5, 6, 7, 8], 4) == [0]  # block 1's key is gone
    a2 = BlockAllocator(1, 2)
    a2.allocate()
    with pytest.raises(OutOfBlocks):
        a2.allocate()
    with pytest.raises(ValueError):
        BlockAllocator(0, 2)


def test_paged_view_reads_through_tables():
    """Rows with cached slots in scattered blocks plus right-aligned new tokens: the view gives the
    left-padded (B, H, S, D) keys the model expects, and positions continue each row's own."""
    from zerotron.inference.paged import BlockPool

    pool = BlockPool(1, 6, 2)
    k0 = torch.arange(3 * 2 * 1., dtype=torch.float64).view(1, 2, 3, 1)  # row 0: 3 slots in blocks 4, 1
    PagedView(pool, [[4, 1]], [0], [3], "cpu").update(0, k0, k0)
    view = PagedView(pool, [[4, 1], [2]], [3, 0], [1, 2], "cpu")
    assert view.S0 == 2 and view.pad.tolist() == [0, 2]  # S = 4 slots: row 0 3 + 1, row 1 2 padding + 2
    assert view.positions(2, 0).tolist() == [[2, 3], [0, 1]]  # row 0's first input is padding
    new = torch.full((2, 2, 2, 1), 9., dtype=torch.float64)
    k, _ = view.update(0, new, new)
    assert k.shape == (2, 2, 4, 1)
    assert torch.equal(k[0], torch.cat([k0[0], new[0, :, 1:]], 1)) and torch.equal(k[1, :, 2:], new[1])
    assert torch.equal(pool.keys[0][:, 8:10, 0], k0[0, :, :2, 0])  # slots 0, 1 of row 0 live in block 4


def test_paged_view_indices_and_incremental_prefix_keys_match_slot_by_slot():
    """Random block tables and lengths: the view's gather (B, S) and destination slots equal the
    slot-by-slot construction (padding reads the row's slot 0); registering a sequence's blocks a
    few tokens at a time with its kept prefix keys gives the same keys and cache as one call."""
    from zerotron.inference.paged import BlockPool

    g = torch.Generator().manual_seed(5)
    p, B = 4, 7
    pool = BlockPool(1, 64, p)
    lens = torch.randint(0, 30, (B,), generator=g).tolist()
    news = torch.randint(1, 6, (B,), generator=g).tolist()
    perm = torch.randperm(64, generator=g).tolist()
    tables, at = [], 0
    for n, m in zip(lens, news):
        k = -(-(n + m) // p)
        tables.append(perm[at:at + k])
        at += k
    view = PagedView(pool, tables, lens, news, "cpu")
    T, S = max(news), view.S0 + max(news)
    gather, dst = [], []
    for tab, n, m in zip(tables, lens, news):
        slots = [tab[s // p] * p + s % p for s in range(n + m)]
        gather.append([slots[0]] * (S - n - m) + slots)
        dst += slots[n:]
    assert view.gather.tolist() == gather and view.dst.tolist() == dst
    assert view.real.sum(1).tolist() == news and T == view.real.size(1)
    toks = torch.randint(0, 9, (40,), generator=g).tolist()
    one, inc = BlockAllocator(12, p), BlockAllocator(12, p)
    table = [one.allocate() for _ in range(10)]
    assert [inc.allocate() for _ in range(10)] == table
    one.register(table, [7] * 3 + toks, 0, 37, base=3)
    keys, start = [], 0
    for end in (1, 5, 8, 9, 21, 37):
        inc.register(table, [7] * 3 + toks, start, end, keys, base=3)
        start = end
    assert inc.key == one.key and inc.cached == one.cached and len(keys) == 9
    assert one.cached and inc.key[table[8]] == keys[8] == BlockAllocator(1, p).chain(keys[7], toks[32:36])


def _mixed(sampled: bool):
    """16 requests: mixed prompt lengths (some past block_size 16 when done), four sharing an
    8-token prefix, two equal prompts (forks), max_tokens 1..12."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, VOCAB, (8,), generator=g).tolist()
    out = []
    for i in range(16):
        n = int(torch.randint(1, 12, (1,), generator=g))
        prompt = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        if i % 4 == 1:
            prompt = shared + prompt[:4]
        if i == 15:
            prompt = list(out[3].prompt)
        sp = SamplingParams(max_tokens=1 + (i * 5) % 12)
        if sampled:
            sp = dataclasses.replace(sp, temperature=0.9, top_k=40, seed=11 + i)
        out.append(Request(prompt, sp))
    return out


def _filled_by_block(dec) -> int:
    """slots_filled counted block by block: each referenced block once, with its fullest row's fill."""
    fill = {}
    for r in dec.rows.values():
        for i, b in enumerate(r.table):
            fill[r.replica, b] = max(fill.get((r.replica, b), 0), min(dec.page, r.cached - i * dec.page))
    return sum(fill.values())


def _run(dec, reqs, arrivals):
    """Steps until every request ended; after each, the KV slot count equals the block-by-block one."""
    out, steps, preempted = {}, 0, 0
    while len(out) < len(reqs):
        res = dec.step([(i, 0, reqs[i]) for i in arrivals.get(steps, [])], [])
        out.update(res.finished)
        preempted += len(res.preempted)
        steps += 1
        assert dec.slots_filled() == _filled_by_block(dec), steps
        assert steps < 400
    return out, steps, preempted


def test_sixteen_mixed_requests_small_pool_equal_alone(single_process):
    arrivals = {0: list(range(12)), 3: [12, 13], 7: [14, 15]}
    for preset, sampled in (("tiny", False), ("tiny", True), ("llama-tiny", False)):
        eng = _local_engine(_model(preset))
        if True:
            reqs = _mixed(sampled)
            alone = eng.generate(reqs)  # the batched engine equals one-by-one (tests/test_inference.py)
            dec = ContinuousDecoder(eng, num_blocks=12, page=4, max_step_tokens=10)
            out, steps, preempted = _run(dec, reqs, arrivals)
            assert [out[i] for i in range(16)] == alone, (preset, sampled)
            assert preempted == dec.preemptions > 0 and dec.blocks_used() == 0 and not dec.rows
            a = dec.alloc[0]
            assert a.hits > 0 and a.misses > 0, (a.hits, a.misses)
            if sampled:
                continue
            # speculative decoding (prompt lookup, 3 tokens): greedy output unchanged, drafts accepted
            spec = ContinuousDecoder(eng, num_blocks=12, page=4, max_step_tokens=10, speculative=3)
            out3, steps3, _ = _run(spec, reqs, arrivals)
            assert [out3[i] for i in range(16)] == alone and spec.accepted > 0 and spec.blocks_used() == 0, preset
            if preset != "tiny":
                continue
            # a big pool and budget: no preemption, the same tokens, fewer steps
            big = ContinuousDecoder(eng, num_blocks=16 * 4, page=4)
            out2, steps2, pre2 = _run(big, reqs, arrivals)
            assert [out2[i] for i in range(16)] == alone and pre2 == 0 and steps2 < steps


def test_forks_share_blocks_copy_on_write(single_process):
    """n = 3 samples of one 6-token prompt (page 4): one prefill, the prompt's blocks shared, the
    partly filled last block copied on each fork's first write; each sample equals it alone."""
    eng = _local_engine(_model("tiny"))
    prompt = [5, 9, 2, 7, 3, 8]
    reqs = [Request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=s)) for s in (1, 2, 3)]
    alone = [eng.generate([r])[0] for r in reqs]
    dec = ContinuousDecoder(eng, num_blocks=8, page=4)
    copies = []
    orig = dec.pool.copy_block
    dec.pool.copy_block = lambda s, d: (copies.append((s, d)), orig(s, d))
    res = dec.step([(i, 0, r) for i, r in enumerate(reqs)], [])
    assert len(res.tokens) == 3 and dec.blocks_used() == 2  # three rows, two blocks
    assert [dec.rows[i].table for i in range(3)] == [[0, 1]] * 3 and dec.alloc[0].refs[:2] == [3, 3]
    out, _, _ = _run(dec, reqs, {})
    assert [out[i] for i in range(3)] == alone
    assert len(copies) == 2 and dec.blocks_used() == 0  # two forks copied block 1; the last wrote it in place
    # greedy forks with speculative decoding: the drafts' blocks come after the copied one
    greedy = [Request(prompt * 2, SamplingParams(max_tokens=7)) for _ in range(3)]
    ref = eng.generate(greedy[:1])[0]
    spec = ContinuousDecoder(eng, num_blocks=12, page=4, speculative=3)
    out, _, _ = _run(spec, greedy, {0: [0, 1, 2]})
    assert [out[i] for i in range(3)] == [ref] * 3 and spec.proposed > 0 and spec.blocks_used() == 0


def test_pool_must_hold_one_row(single_process):
    eng = _local_engine(_model("tiny"))
    with pytest.raises(ValueError, match="cannot hold one full-context row"):
        ContinuousDecoder(eng, num_blocks=3, page=4)
    # serve --kv-cache-mb 1e23: refused at once (it grew Python block lists to 7.5 GB before)
    with pytest.raises(ValueError, match="more than this rank's .* GiB of memory"):
        ContinuousDecoder(eng, num_blocks=10**20, page=4)
    # serve --kv-cache-mb 1e8 was killed by the OOM killer at start (the allocator's free list), --kv-page 1e9
    # served and failed every request: one block past the rank's memory is refused before any table is made
    from zerotron.inference.continuous import kv_block_bytes, rank_memory_bytes

    over = rank_memory_bytes(eng.device) // kv_block_bytes(eng, 8) + 1
    with pytest.raises(ValueError, match=f"the KV pool of {over:,} blocks of 8 slots needs .* GiB per rank, "
                                         r"more than this rank's .* GiB of memory: give less KV cache memory"):
        ContinuousDecoder(eng, num_blocks=over, page=8)
    with pytest.raises(ValueError, match="blocks of 1,000,000,000 slots needs"):
        ContinuousDecoder(eng, page=10**9)  # the default pool: 32 full-context rows


def test_draft_model_speculation_equals_plain_greedy(single_process):
    """--speculative draft: a small draft model's greedy guesses, verified by the target: the
    target's greedy tokens exactly; the target itself as its own draft has every guess accepted."""
    from test_inference import BLOCK

    from zerotron.models import registry

    eng = _local_engine(_model("tiny"))
    reqs = _mixed(False)[:4]
    alone = eng.generate(reqs)
    torch.manual_seed(1)
    other = registry.build_model(registry.preset_config("tiny", vocab_size=VOCAB, block_size=BLOCK, n_layer=1))
    for w in other.parameters():  # far from the target: many guesses rejected
        w.data.normal_(0, 1)
    for draft, all_accepted in ((other.double().eval(), False), (_model("tiny"), True)):
        dec = ContinuousDecoder(eng, num_blocks=40, page=4, speculative=4, draft_model=draft)
        out, _, _ = _run(dec, reqs, {0: list(range(4))})
        assert [out[i] for i in range(4)] == alone and dec.proposed > 0
        assert (dec.accepted == dec.proposed) == all_accepted, (dec.accepted, dec.proposed)
    with pytest.raises(ValueError, match="vocabulary"):
        ContinuousDecoder(eng, speculative=2, draft_model=registry.build_model(registry.preset_config(
            "tiny", vocab_size=VOCAB + 1, block_size=BLOCK)))


def test_ngram_proposer():
    from zerotron.inference.speculative import ngram_propose

    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # after the earlier "1 2 3"
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 9) == [9, 1, 2, 3]  # as many as follow
    assert ngram_propose([4, 2, 7, 5, 2], 3) == [7, 5, 2]  # only the 1-gram "2" occurs before
    assert ngram_propose([5, 5, 5, 5, 5], 3) == [5, 5]  # the earliest 3-gram match: 2 tokens follow it, not 1
    assert ngram_propose([1, 2, 3], 3) == [] and ngram_propose([1, 1], 0) == [] and ngram_propose([7], 2) == []


def test_accept_drafts_keeps_the_target_distribution():
    """Rejection sampling with point-mass proposals: the first emitted token is distributed as the
    target's p_0 whatever the draft, the second (after an accepted draft) as p_1; greedy rows
    accept exactly the argmax prefix (Leviathan et al. 2023)."""
    from zerotron.inference.speculative import accept_drafts

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, 0.2, 0.3, 1.0], [1, 1, 1, 1, 1.]],
                          dtype=torch.float64)
    p = torch.softmax(logits, -1)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=3, temperature=1.0)
    N = 6000
    first, second, lengths = torch.zeros(5), torch.zeros(5), []
    for _ in range(N):
        out = accept_drafts(logits, [1, 4], params, g)
        lengths.append(len(out))
        first[out[0]] += 1
        if out[0] == 1:
            second[out[1]] += 1
    assert (first / N - p[0]).abs().sum() < 0.05, (first / N, p[0])
    assert (second / second.sum() - p[1]).abs().sum() < 0.08, (second / second.sum(), p[1])
    assert set(lengths) == {1, 2, 3}
    greedy = SamplingParams(max_tokens=3)
    assert accept_drafts(logits, [0, 2], greedy, None) == [0, 1]  # 0 accepted, 2 rejected: argmax 1
    assert accept_drafts(logits, [0, 1], greedy, None) == [0, 1, 0]  # both accepted, then the argmax of row 2
    assert accept_drafts(logits, [3, 1], greedy, None) == [0]
    assert accept_drafts(logits[:2], [0], greedy, None) == [0, 1]


def shared_prefix_requests():
    """5 greedy requests behind one 8-token prefix (2 blocks of 4), 1-2 tokens of their own (no two
    prompts equal), 4 new tokens each (within the context of 16)."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, VOCAB, (8,), generator=g).tolist()
    return [Request(shared + [10 + i, 20 + i][:1 + i % 2], SamplingParams(max_tokens=4)) for i in range(5)]


def test_shared_prefix_attention_equals_whole_context(single_process, monkeypatch):
    """Shared-prefix (cascade) attention, fp64: the kernels -- all queries against the shared prefix
    once, each row's suffix with its causal and padding masks, merged by log-sum-exp -- equal
    causal attention over each row's whole context (grouped-query heads, T = 1 and T = 3 with left
    padding); and rows behind one 2-block prefix, arriving together, share its blocks (the first
    prefills them, the others wait one step and find them cached) and decode (GPT-2, Llama with
    grouped-query heads) to the tokens they get alone, with the prefix path taken (off: not taken,
    same tokens)."""
    from zerotron.inference import prefix_attention as pa
    from zerotron.inference.prefix_attention import prefix_attention, suffix_attention
    from zerotron.models.base import causal_attention
    from zerotron.parallel.context.ring import merge

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, P = 3, 4, 2, 8, 12
    kernel = pa._fused
    cases = [(T, pad, fused) for T, pad in ((1, [0, 2, 5]), (3, [1, 0, 8])) for fused in (True, False)]
    for T, pad, fused in cases:  # row 2's first query (T = 3) is padding; torch's fused kernel, and plain torch
        monkeypatch.setattr(pa, "_fused", kernel if fused else lambda q: None)
        S = 7 + T  # each row's own slots after the prefix, left-padded by pad[b]
        q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
        kp, vp = (torch.randn(Hkv, P, D, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
        pad_t = torch.tensor(pad)
        got, _ = merge(*prefix_attention(q, kp, vp), *suffix_attention(q, k, v, pad_t))
        for b in range(B):  # row b alone: its prefix + its unpadded slots, plain causal attention
            kb = torch.cat([kp, k[b, :, pad[b]:]], 1)[None]
            vb = torch.cat([vp, v[b, :, pad[b]:]], 1)[None]
            real = slice(max(0, pad[b] - (S - T)), T)  # queries that are not padding
            want = causal_attention(q[b:b + 1, :, real], kb, vb, 0.0)
            torch.testing.assert_close(got[b:b + 1, :, real], want, rtol=1e-12, atol=1e-12)
    monkeypatch.undo()
    reqs = shared_prefix_requests()
    for preset in ("tiny", "llama-tiny"):
        eng = _local_engine(_model(preset))
        alone = eng.generate(reqs)
        for on in (True, False):
            # all five arrive at once: the first prefills the 8 shared tokens, the others wait one step
            # for its blocks (in-batch prefix caching) and then reuse both (hits 4 x 2), not copies
            dec = ContinuousDecoder(eng, num_blocks=32, page=4, shared_prefix=on)
            out, steps, _ = _run(dec, reqs, {0: [0, 1, 2, 3, 4]})
            assert [out[i] for i in range(5)] == alone, (preset, on)
            assert dec.alloc[0].hits == 8 and dec.alloc[0].misses == 2, (dec.alloc[0].hits, dec.alloc[0].misses)
            assert (dec.prefix_forwards > 0) == on, (preset, on, dec.prefix_forwards)
