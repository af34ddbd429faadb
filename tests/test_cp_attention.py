"""Context-parallel attention (issue 28): ring (zigzag and contiguous splits) and all-to-all
(Ulysses) attention over cp = 1, 2, 4 ranks equal single-process causal attention over the full
sequence, forward rows and dq/dk/dv, in fp64 (MHA and GQA); their traffic matches the formulas;
all-to-all refuses cp not dividing the kv heads. One spawn of 4 ranks runs every case (cp = 2 on the
subgroups {0,1} and {2,3}, cp = 1 on single-rank groups)."""
import math

import pytest
import torch

from zerotron.testing import run_ranks

B, T, D = 2, 16, 8
HEADS = ((4, 4), (8, 4), (4, 2))  # (H, H_kv): MHA and two GQA ratios
IMPLS = ("ring-zigzag", "ring-contiguous", "a2a")


def _local(x, cp, rank, layout):
    """This cp rank's part of the full (B, N, T, D) tensor x under ``layout``."""
    from zerotron.parallel.context.split import split_sequence

    if layout == "contiguous":
        t = x.size(2) // cp
        return x[:, :, rank * t:(rank + 1) * t]
    return split_sequence(x, cp, rank, dim=2)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _case(group, impl, H, Hkv, dtype, seed, data_layout=None, checkpoint=False, autocast=False):
    """Run one case on this rank: errors of out/dq/dk/dv against the full reference, and the
    traffic (bytes by (op, tag)) of the forward and of the backward."""
    from zerotron.distributed import comm
    from zerotron.models.base import causal_attention
    from zerotron.parallel.context.a2a import a2a_attention
    from zerotron.parallel.context.attention import context_attention
    from zerotron.parallel.context.ring import ring_attention

    cp, rank = group.size(), group.rank()
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = causal_attention(*ref, 0.0)
    out.backward(dout)
    want = [out.detach()] + [t.grad for t in ref]

    layout = "contiguous" if impl == "ring-contiguous" else "zigzag"
    # leaves stored (B, T, N, D) and passed as (B, N, T, D) views, non-contiguous as the model's are
    leaves = [_local(t, cp, rank, data_layout or layout).to(dtype).transpose(1, 2).contiguous().requires_grad_()
              for t in (q, k, v)]
    loc = [t.transpose(1, 2) for t in leaves]
    if impl == "a2a":
        fn = lambda q, k, v: a2a_attention(q, k, v, group)  # noqa: E731
    elif layout == "zigzag":
        fn = lambda q, k, v: context_attention(q, k, v, group)  # noqa: E731  (the contract's entry, default ring)
    else:
        fn = lambda q, k, v: ring_attention(q, k, v, group, layout="contiguous")  # noqa: E731
    comm.STATS.reset()
    if autocast:  # bf16 training: the ring's block math stays in fp32 (autocast off inside)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fn(*loc)
    elif checkpoint:  # activation checkpointing: the forward (and its traffic) runs again in the backward
        got = torch.utils.checkpoint.checkpoint(fn, *loc, use_reentrant=False)
    else:
        got = fn(*loc)
    fwd = {(op, tag): n for (op, g, tag), n in comm.STATS.bytes.items() if g == "cp"}
    comm.STATS.reset()
    got.backward(_local(dout, cp, rank, data_layout or layout).to(dtype).transpose(1, 2).contiguous().transpose(1, 2))
    bwd = {(op, tag): n for (op, g, tag), n in comm.STATS.bytes.items() if g == "cp"}
    grads = [t.grad.transpose(1, 2) for t in leaves]
    errs = [_rel(g.double(), _local(w, cp, rank, layout)) for g, w in zip([got.detach()] + grads, want)]
    assert got.dtype == dtype and all(g.dtype == dtype for g in grads)
    return {"errs": errs, "fwd": fwd, "bwd": bwd}


def _all_cases():
    import torch.distributed as dist

    from zerotron.distributed.comm import NamedGroup

    r = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    singles = [dist.new_group([i]) for i in range(4)]
    groups = {1: NamedGroup(singles[r], "cp"), 2: NamedGroup(pairs[r // 2], "cp"), 4: NamedGroup(dist.group.WORLD, "cp")}
    res = {}
    for cp, group in groups.items():
        for H, Hkv in HEADS:
            for impl in IMPLS:
                key = (cp, H, Hkv, impl)
                if impl == "a2a" and Hkv % cp:
                    try:
                        _case(group, impl, H, Hkv, torch.float64, 0)
                        res[key] = "no error"
                    except ValueError as e:
                        res[key] = str(e)
                    continue
                res[key] = _case(group, impl, H, Hkv, torch.float64, 1000 * cp + 10 * H + Hkv)
    # the comparison can fail: ring told "contiguous" but fed the zigzag split
    res["mismatch"] = _case(groups[4], "ring-contiguous", 4, 2, torch.float64, 7, data_layout="zigzag")["errs"]
    for impl in ("ring-zigzag", "a2a"):  # under activation checkpointing (recompute in the backward)
        res[("checkpoint", impl)] = _case(groups[4], impl, 8, 4, torch.float64, 11, checkpoint=True)
    for dtype in (torch.float32, torch.bfloat16):  # lower precision runs (block math in fp32)
        for impl in ("ring-zigzag", "a2a"):
            res[(str(dtype), impl)] = _case(groups[2], impl, 8, 4, dtype, 3)["errs"]
    res["autocast"] = _case(groups[2], "ring-zigzag", 8, 4, torch.float32, 3, autocast=True)["errs"]
    from zerotron.bench.context import rank_attention_times

    res["bench"] = [rank_attention_times(groups[4], 64, layout, heads=2, head_dim=8, repeats=2, warmup=0)
                    for layout in ("zigzag", "contiguous")]
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 4, timeout_s=60)


def _cases(res):
    return [(k, v) for k, v in res.items() if isinstance(k, tuple) and len(k) == 4 and isinstance(v, dict)]


def test_equals_single_process(results):
    worst = 0.0
    for rank, res in enumerate(results):
        assert len(_cases(res)) == 3 * 3 * 3 - 1  # a2a refuses H_kv = 2 at cp = 4
        for key, r in _cases(res):
            for name, e in zip(("out", "dq", "dk", "dv"), r["errs"]):
                assert e <= 1e-10, f"rank {rank} case {key}: {name} relative error {e:.3g}"
                worst = max(worst, e)
    print(f"worst fp64 relative error over all cases/ranks: {worst:.3g}")


def test_can_fail(results):
    assert all(min(res["mismatch"]) > 1e-3 for res in results[1:])  # rank 0's zigzag and contiguous chunks share chunk 0


def test_lower_precision(results):
    for res in results[:2]:
        print({k: f"{max(v):.2g}" for k, v in res.items() if isinstance(k, tuple) and k[0] in ("torch.float32", "torch.bfloat16")})
        for impl in ("ring-zigzag", "a2a"):
            assert max(res[(str(torch.float32), impl)]) < 1e-5
            assert max(res[(str(torch.bfloat16), impl)]) < 5e-2
        assert max(res["autocast"]) < 1e-5


def test_traffic(results):
    for res in results:
        for (cp, H, Hkv, impl), r in _cases(res):
            f8 = 8  # fp64 bytes
            kv = 2 * B * Hkv * (T // cp) * D * f8  # one K and one V block
            qb = B * H * (T // cp) * D * f8
            if impl.startswith("ring"):
                want_f = {("send", "cp_kv"): (cp - 1) * kv, ("recv", "cp_kv"): (cp - 1) * kv} if cp > 1 else {}
                want_b = dict(want_f)
                if cp > 1:  # the dK/dV accumulators make cp hops home
                    want_b.update({("send", "cp_dkv"): cp * kv, ("recv", "cp_dkv"): cp * kv})
            else:  # q, k, v in, the output back: each all-to-all counted by its input bytes
                want_f = {("all_to_all", "cp_a2a"): 2 * qb + kv} if cp > 1 else {}
                want_b = want_f
            assert r["fwd"] == want_f, (cp, H, Hkv, impl)
            assert r["bwd"] == want_b, (cp, H, Hkv, impl)


def test_a2a_refuses_kv_heads(results):
    for res in results:
        msgs = [v for k, v in res.items() if isinstance(k, tuple) and len(k) == 4 and isinstance(v, str)]
        assert len(msgs) == 1 and all("cp (4) to divide the kv heads (2)" in m for m in msgs), msgs


def test_lse_merge():
    """Merging the softmax attention of two disjoint key sets equals attention over their union."""
    from zerotron.parallel.context.ring import merge

    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 12, generator=g, dtype=torch.float64) * 4
    v = torch.randn(3, 12, 6, generator=g, dtype=torch.float64)
    full = torch.softmax(s, -1) @ v
    out, lse = None, None
    for part in (slice(0, 7), slice(7, 12)):
        blse = torch.logsumexp(s[..., part], -1)
        out, lse = merge(out, lse, torch.softmax(s[..., part], -1) @ v[:, part], blse)
    assert torch.allclose(out, full, rtol=1e-13, atol=0)
    assert torch.allclose(lse, torch.logsumexp(s, -1), rtol=1e-14, atol=0)
    assert math.isfinite(out.sum().item())


def test_rank_work():
    """The zigzag split gives every rank the same attention work; the contiguous one gives rank r
    4(r+1) blocks (the last rank (2cp)/(2) = cp times the first's), and both cover the causal
    triangle (every unmasked pair computed once)."""
    from zerotron.parallel.context.ring import rank_work

    for cp in (1, 2, 3, 4, 8):
        assert [rank_work("zigzag", cp, r) for r in range(cp)] == [2 * cp + 1] * cp
        assert [rank_work("contiguous", cp, r) for r in range(cp)] == [4 * (r + 1) for r in range(cp)]
        n = 2 * cp  # chunks: n(n-1)/2 full pairs and n diagonal ones in total
        assert sum(rank_work("zigzag", cp, r) for r in range(cp)) == n * (n - 1) // 2 + n


def test_bench_helper(results):
    """bench.context.rank_attention_times reports per-rank times and the expected work."""
    for r, res in enumerate(results):
        zig, cont = res["bench"]
        assert (zig["rank"], zig["layout"], cont["layout"]) == (r, "zigzag", "contiguous")
        assert zig["work_blocks"] == 9 and cont["work_blocks"] == 4 * (r + 1)
        for row in (zig, cont):
            assert row["compute_s"] > 0 and row["wall_s"] >= row["compute_s"] and row["wait_s"] >= 0
            assert row["transfer_s"] > 0 and row["hidden_fraction_raw"] == 1 - row["wait_s"] / row["transfer_s"]
            assert row["hidden_fraction"] == 1 - row["exposed_s"] / row["transfer_s"] >= row["hidden_fraction_raw"]


def test_activation_checkpointing(results):
    """Under torch.utils.checkpoint the forward is recomputed in the backward: same results, and the
    backward's traffic is a forward's plus a backward's."""
    for res in results:
        ring, a2a = res[("checkpoint", "ring-zigzag")], res[("checkpoint", "a2a")]
        assert max(ring["errs"] + a2a["errs"]) <= 1e-10
        kv = 2 * B * 4 * (T // 4) * D * 8
        assert ring["bwd"][("send", "cp_kv")] == 2 * 3 * kv and ring["bwd"][("send", "cp_dkv")] == 4 * kv
        fwd, out_bytes = a2a["fwd"][("all_to_all", "cp_a2a")], B * 8 * (T // 4) * D * 8
        # torch's non-reentrant checkpoint stops recomputing once the saved tensors are back (early
        # stop), so the output's all-to-all (which saves nothing) may not run again
        assert 2 * fwd - out_bytes <= a2a["bwd"][("all_to_all", "cp_a2a")] <= 2 * fwd
