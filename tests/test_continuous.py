"""Continuous (iteration-level) batching (zerotron.inference.continuous): requests that join a
running batch at later steps, rows that are cancelled mid-way, eos and stop strings, and the KV
cache rows joining/leaving, give every request exactly the tokens it gets alone
(``Engine.generate`` of that request), greedy and sampled, in fp64, for GPT-2 and Llama, on every
layout (single process here; dp, tp, pp and their products on 4 ranks in one spawn)."""
import copy
import dataclasses

import torch
from test_inference import _local_engine, _model, _requests
from test_paged import _mixed, shared_prefix_requests

from zerotron.inference.batch import Request
from zerotron.inference.continuous import ContinuousDecoder
from zerotron.testing import run_ranks

ARRIVALS = {0: [0], 2: [1, 2], 5: [3]}  # step -> requests that join then (3 joins mid-decode)
MIXED_ARRIVALS = {0: list(range(12)), 3: [12, 13], 7: [14, 15]}
MIXED_LAYOUTS = ("tp2xdp2", "pp2xtp2", "pp4")  # dp, tp, pp x tp, naive model parallel (pp4)


def _drive(dec: ContinuousDecoder, reqs, arrivals=ARRIVALS, cancel_at=None):
    """Run the iterations a scheduler would: joins at the given steps, each to the least-loaded dp
    replica; ``cancel_at`` (step, request) cancels that request then. Returns ({request: tokens}
    of the finished ones, {request: tokens streamed before its cancel}, steps taken)."""
    out, streamed, step = {}, {i: [] for i in range(len(reqs))}, 0
    cancelled = set()
    while len(out) + len(cancelled) < len(reqs):
        joins = []
        for i in arrivals.get(step, []):
            load = dec.replica_load()
            rep = min(range(len(load)), key=lambda k: (load[k] + sum(1 for j in joins if j[1] == k), k))
            joins.append((i, rep, reqs[i]))
        cancel = [cancel_at[1]] if cancel_at and step == cancel_at[0] else []
        cancelled.update(cancel)
        res = dec.step(joins, cancel)
        for rid, toks in res.tokens.items():
            streamed[rid] += toks
        assert not set(res.finished) & cancelled
        out.update(res.finished)
        step += 1
        assert step < 400
    return out, streamed, step


def test_joining_rows_equal_alone_single_process(single_process):
    for preset in ("tiny", "llama-tiny"):
        model = _model(preset)
        eng = _local_engine(model)
        for sampled in (False, True):
            reqs = _requests(sampled)
            alone = [eng.generate([r])[0] for r in reqs]
            dec = ContinuousDecoder(eng, page=4)
            out, streamed, steps = _drive(dec, reqs)
            assert [out[i] for i in range(4)] == alone, (preset, sampled)
            assert all(streamed[i] == alone[i] for i in range(4))
            assert dec.running == 0 and dec.order == [] and dec.blocks_used() == 0
            assert steps < sum(len(a) for a in alone)  # rows really shared iterations
            # every request arriving at once, and one by one in reverse: the same tokens
            out2, _, _ = _drive(ContinuousDecoder(eng, page=4), reqs, {0: [3, 2, 1, 0]})
            assert [out2[i] for i in range(4)] == alone


def test_cancel_eos_stop_and_zero_tokens(single_process):
    model = _model("tiny")
    eng = _local_engine(model)
    reqs = _requests(False)
    alone = [eng.generate([r])[0] for r in reqs]
    dec = ContinuousDecoder(eng, page=4)
    out, streamed, _ = _drive(dec, reqs, cancel_at=(4, 1))  # request 1 joined at step 2: 2 tokens, then gone
    assert 1 not in out and streamed[1] == alone[1][:2]
    assert [out[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert dec.running == 0 and dec.blocks_used() == 0
    # eos and stop strings end a row where they end it alone; max_tokens 0 finishes at join
    eos = alone[1][3]
    e_eng = _local_engine(model, eos_id=eos)
    out, _, _ = _drive(ContinuousDecoder(e_eng, page=4), reqs)
    assert [out[i] for i in range(4)] == [e_eng.generate([r])[0] for r in reqs]
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    stop = (f"{alone[2][1]}><{alone[2][2]}>",)
    s_reqs = [Request(r.prompt, dataclasses.replace(r.params, stop=stop)) for r in reqs]
    s_eng = _local_engine(model, decode=decode)
    out, _, _ = _drive(ContinuousDecoder(s_eng, page=4), s_reqs)
    assert [out[i] for i in range(4)] == [s_eng.generate([r])[0] for r in s_reqs] and len(out[2]) < len(alone[2])
    z = [Request(reqs[0].prompt, dataclasses.replace(reqs[0].params, max_tokens=0))] + reqs[1:]
    out, _, _ = _drive(ContinuousDecoder(eng, page=4), z)
    assert out[0] == [] and [out[i] for i in (1, 2, 3)] == alone[1:]


def test_pooled_cache_rows_join_leave_and_trim():
    """Rows appended after the running ones keep their values and positions (running rows shift
    right once when the newcomers are longer); removed rows are replaced by rows from the end;
    trim drops the slots that are padding in every row."""
    from zerotron.inference.kvcache import PooledKVCache, StaticKVCache

    def fresh(b, n, pad):
        c = StaticKVCache(2, torch.tensor(pad), n)
        for i in range(2):
            c.update(i, torch.randn(b, 2, n, 3, dtype=torch.float64), torch.randn(b, 2, n, 3, dtype=torch.float64))
        return c
    pool = PooledKVCache(2, 16)
    a, b = fresh(1, 3, [0]), fresh(2, 5, [0, 2])
    pool.append(a)
    assert (pool.B, pool.S, pool.pad.tolist()) == (1, 3, [0])
    pool.append(b)  # longer: row 0 moves right by 2
    assert (pool.B, pool.S, pool.pad.tolist()) == (3, 5, [2, 0, 2])
    assert torch.equal(pool.keys[1][0, :, 2:5], a.keys[1][0]) and torch.equal(pool.values[0][1:3, :, :5], b.values[0])
    assert torch.equal(pool.positions(1, 0), torch.tensor([[3], [5], [3]]))  # each row's own next position
    k, v = pool.update(0, torch.ones(3, 2, 1, 3, dtype=torch.float64), torch.ones(3, 2, 1, 3, dtype=torch.float64))
    assert k.shape == (3, 2, 6, 3) and pool.S == 5
    pool.commit(1)
    assert pool.S == 6
    before = pool.keys[0][2, :, :6].clone()
    assert pool.remove([1]) == [0, 2] and pool.B == 2 and pool.pad.tolist() == [2, 2]  # row 2 took row 1's place
    assert torch.equal(pool.keys[0][1, :, :6], before)
    assert pool.trim() == 2 and pool.S == 4 and pool.pad.tolist() == [0, 0]
    assert torch.equal(pool.keys[0][1, :, :4], before[:, 2:])
    assert pool.remove([0, 1]) == [] and (pool.B, pool.S) == (0, 0)


LAYOUTS = [("dp4", 4, 1, 1), ("tp2xdp2", 2, 2, 1), ("pp2xdp2", 2, 1, 2), ("pp2xtp2", 1, 2, 2), ("pp4", 1, 1, 4),
           ("tp4", 1, 4, 1)]


def _layouts_worker():
    import torch.distributed as dist

    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.inference.engine import Engine

    res = {}
    for preset in ("tiny", "llama-tiny"):
        dense = _model(preset)
        for name, dp, tp, pp in LAYOUTS:
            if preset == "llama-tiny" and tp == 4:
                continue
            eng = Engine(copy.deepcopy(dense), Mesh(ParallelDims(dist.get_world_size(), dp, tp, pp), torch.device("cpu")))
            for sampled in (False, True):
                out, streamed, _ = _drive(ContinuousDecoder(eng, page=4), _requests(sampled), cancel_at=(4, 1))
                res[(preset, name, sampled)] = (out, streamed[1])
            if preset == "tiny" and name in MIXED_LAYOUTS:  # 16 concurrent mixed-length requests on a small paged pool (preemptions)
                # (and speculative decoding: 3 prompt-lookup tokens per row and step)
                dec = ContinuousDecoder(eng, num_blocks=6 if dp == 1 else 4, page=4, max_step_tokens=10, speculative=3)
                out, _, _ = _drive(dec, _mixed(False), MIXED_ARRIVALS)
                res[("mixed", name)] = ([out[i] for i in range(16)], dec.preemptions, sum(a.hits for a in dec.alloc),
                                        dec.accepted)
                # rows behind one shared prefix, arriving together: shared blocks, attended to once per forward
                dec = ContinuousDecoder(eng, num_blocks=32, page=4)
                out, _, _ = _drive(dec, shared_prefix_requests(), {0: [0, 1, 2, 3, 4]})
                res[("shared", name)] = ([out[i] for i in range(5)], dec.prefix_forwards)
    return res


def test_every_layout_equals_alone(single_process):
    """Each layout (naive model parallel: pp4 and pp2 here, one stage busy at a time) gives each
    request its tokens alone; 16 concurrent mixed-length greedy requests on a pool too small for
    them all (preemptions, prefix hits, forks), with speculative decoding, and rows behind one
    shared prefix (attended to once per forward), give the single-process tokens."""
    ref = {}
    for preset in ("tiny", "llama-tiny"):
        eng = _local_engine(_model(preset))
        for sampled in (False, True):
            ref[(preset, sampled)] = [eng.generate([r])[0] for r in _requests(sampled)]
    mixed = _local_engine(_model("tiny")).generate(_mixed(False))
    shared = _local_engine(_model("tiny")).generate(shared_prefix_requests())
    results = run_ranks(_layouts_worker, 4, timeout_s=180)
    for rank, res in enumerate(results):
        assert len(res) == 2 * len(LAYOUTS) + 2 * (len(LAYOUTS) - 1) + 2 * len(MIXED_LAYOUTS)
        hits = 0
        for name in MIXED_LAYOUTS:
            out, forwards = res.pop(("shared", name))
            assert out == shared and forwards > 0, (rank, name, forwards)
            out, preempted, h, accepted = res.pop(("mixed", name))
            assert out == mixed and preempted > 0 and accepted > 0, (rank, name, preempted, accepted)
            hits += h
        assert hits > 0  # (under dp2 the shared-prefix rows meet on a pool of 4 blocks: maybe none there)
        for (preset, name, sampled), (out, cut) in res.items():
            alone = ref[(preset, sampled)]
            assert {i: out[i] for i in (0, 2, 3)} == {i: alone[i] for i in (0, 2, 3)} and 1 not in out, (rank, name)
            assert cut == alone[1][:2], (rank, name, sampled)


def test_bench_serve_runs_both_modes(tmp_path, single_process):
    """``zerotron bench serve`` (tiny run): both batchers answer every request with the same tokens,
    and the rows name the paired ratios (figures, not timed assertions)."""
    import json

    from zerotron.bench.serve import main

    out = tmp_path / "s.json"
    assert main(["--requests", "5", "--rounds", "2", "--interval-ms", "5", "--max-tokens", "3,9", "--json", str(out)]) == 0
    c, w = json.loads(out.read_text())
    assert (c["mode"], w["mode"]) == ("continuous", "window") and c["outputs_equal"]
    assert c["new_tokens"] == w["new_tokens"] == 3 + 9 + 3 + 9 + 3 and c["steps"] >= 9 and c["rounds"] == 2
    assert c["ratio_output_tokens_per_s"] > 0 and len(c["latency_p95_s_rounds"]) == 2
    assert main(["--max-tokens", "0"]) == 2
