"""Tensor/sequence parallelism: every layer, the loss and the whole GPT equal the dense computation.

One 2-rank and one 4-rank spawn (tp = world size) run all checks; each rank builds the dense model
from the same seed and compares against it on the same inputs. Collective counts come from comm.STATS.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotron.models.gpt import GPT, GPTConfig
from zerotron.parallel.tensor.transform import MODEL_PARALLEL, REPLICATED, RNGStatesTracker
from zerotron.testing import run_ranks

CFG = dict(vocab_size=67, block_size=16, n_layer=2, n_head=4, n_embd=32)  # 67: not divisible by tp
B, T = 2, 8
CLOSE = dict(rtol=1e-5, atol=1e-6)


def _close(a, b, what, **tol):
    torch.testing.assert_close(a, b, **{**CLOSE, **tol}, msg=lambda m: f"{what}: {m}")


def _check_layers(g, n, r):
    """Column/row/vocab layers and the vocab-parallel loss vs dense, forward and backward."""
    from zerotron.parallel.tensor.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        full_tensor,
        scatter_to_sp,
        shard_tensor,
        vocab_parallel_cross_entropy,
    )
    torch.manual_seed(1)
    dense = nn.Linear(12, 8 * n)
    x, gy = torch.randn(B, T, 12, requires_grad=True), torch.randn(B, T, 8 * n)
    dense(x).backward(gy)
    seq = lambda t: t.chunk(n, 1)[r]
    for sp in (False, True):
        for gather in (False, True):
            col = ColumnParallelLinear.from_dense(dense, g, gather_output=gather, sequence_parallel=sp)
            xi = (seq(x.detach()) if sp else x.detach()).clone().requires_grad_()
            y = col(xi)
            y_ref = dense(x).detach()
            _close(y, y_ref if gather else shard_tensor(y_ref, 2, g), f"column fwd sp={sp}")
            y.backward(gy if gather else shard_tensor(gy, 2, g))
            _close(xi.grad, seq(x.grad) if sp else x.grad, f"column dx sp={sp}")
            _close(full_tensor(col.weight, g, col.weight.grad), dense.weight.grad, "column dW")
            _close(full_tensor(col.bias, g, col.bias.grad), dense.bias.grad, "column db")

    dense = nn.Linear(8 * n, 12)
    dense.zero_grad()
    x, gy = torch.randn(B, T, 8 * n, requires_grad=True), torch.randn(B, T, 12)
    y_ref = dense(x)
    y_ref.backward(gy)
    for sp, parallel_in in ((False, True), (False, False), (True, True)):
        row = RowParallelLinear.from_dense(dense, g, input_is_parallel=parallel_in, sequence_parallel=sp)
        xi = (shard_tensor(x, 2, g) if parallel_in else x.detach().clone()).requires_grad_()
        y = row(xi)
        _close(y, seq(y_ref.detach()) if sp else y_ref.detach(), f"row fwd sp={sp}")
        y.backward(seq(gy) if sp else gy)
        _close(xi.grad, shard_tensor(x.grad, 2, g) if parallel_in else x.grad, "row dx")
        _close(full_tensor(row.weight, g, row.weight.grad), dense.weight.grad, "row dW")
        db = row.bias.grad.clone()
        if sp:  # each rank saw only its sequence shard: the sum over ranks is the gradient
            torch.distributed.all_reduce(db, group=g.pg)
        _close(db, dense.bias.grad, f"row db sp={sp}")
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(8 * n, 4, g, input_is_parallel=False, sequence_parallel=True)

    V = CFG["vocab_size"]
    emb = nn.Embedding(V, 16)
    idx = torch.randint(0, V, (B, T))
    idx[0, :3] = torch.tensor([0, V - 1, V // 2])
    gy = torch.randn(B, T, 16)
    emb(idx).backward(gy)
    for sp in (False, True):
        ve = VocabParallelEmbedding.from_dense(emb, g, sequence_parallel=sp)
        assert ve.weight.shape == (-(-V // n), 16)
        y = ve(idx)
        _close(y, seq(emb(idx).detach()) if sp else emb(idx).detach(), f"embedding fwd sp={sp}")
        y.backward(seq(gy) if sp else gy)
        _close(full_tensor(ve.weight, g, ve.weight.grad), emb.weight.grad, "embedding dW")
    x = torch.randn(B, T, 4, requires_grad=True)
    scatter_to_sp(x, g).backward(seq(torch.ones(B, T, 4)) * (r + 1))
    _close(x.grad, torch.cat([torch.full((B, T // n, 4), k + 1.0) for k in range(n)], 1), "scatter_to_sp bwd")

    # vocab-parallel cross-entropy, with padding columns that must never count
    v_pad = -(-V // n) * n
    logits = (3 * torch.randn(B, T, V)).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    targets[0, 0], targets[1, 1], targets[1, 2] = -100, V - 1, 0
    for eps in (0.0, 0.1):
        logits.grad = None
        ref = F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-100, label_smoothing=eps,
                              reduction="sum")
        ref.backward()
        local = shard_tensor(logits, 2, g, padded_size=v_pad).requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, r * v_pad // n, V, g, label_smoothing=eps)
        _close(loss, ref.detach(), f"loss eps={eps}", atol=1e-4)
        loss.backward()
        _close(local.grad, shard_tensor(logits.grad, 2, g, padded_size=v_pad), f"loss grad eps={eps}")


def _models(g, sp, seed=0, **over):
    from zerotron.parallel.tensor.transform import apply_tensor_parallel
    cfg = GPTConfig(**{**CFG, **over})
    torch.manual_seed(seed)
    dense = GPT(cfg)
    torch.manual_seed(seed)
    return dense, apply_tensor_parallel(GPT(cfg), g, sequence_parallel=sp, seed=seed)


def _expected_calls(n_layer, sp, backward=True):
    """Theory: per block, 2 all-reduces forward + 2 backward (attention and MLP g/f); with SP each is
    replaced by an all-gather and a reduce-scatter. Embedding: g forward (SP: reduce-scatter forward,
    all-gather backward); LM head: f backward (SP: all-gather forward, reduce-scatter backward);
    loss: 2 all-reduces; SP adds one all-reduce of replicated gradients."""
    L = n_layer
    if not sp:
        e = {("all_reduce", "tp", "tp_block"): 2 * L, ("all_reduce", "tp", "tp_embed"): 1,
             ("all_reduce", "tp", "tp_loss"): 2}
        if backward:
            e.update({("all_reduce", "tp", "tp_block_bwd"): 2 * L, ("all_reduce", "tp", "tp_head_bwd"): 1})
        return e
    e = {("all_gather", "tp", "tp_block"): 2 * L, ("reduce_scatter", "tp", "tp_block"): 2 * L,
         ("reduce_scatter", "tp", "tp_embed"): 1, ("all_gather", "tp", "tp_head"): 1,
         ("all_reduce", "tp", "tp_loss"): 2}
    if backward:
        e.update({("all_gather", "tp", "tp_block_bwd"): 2 * L, ("reduce_scatter", "tp", "tp_block_bwd"): 2 * L,
                  ("all_gather", "tp", "tp_embed_bwd"): 1, ("reduce_scatter", "tp", "tp_head_bwd"): 1,
                  ("all_reduce", "tp", "tp_grad"): 1})
    return e


def _batch(gen, V=CFG["vocab_size"]):
    idx, tgt = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    tgt[0, -1] = -100
    return idx, tgt


def _check_model(g, n, r):
    """Whole GPT: logits, loss, every gradient, comm counts, training steps, export, generation."""
    from zerotron.distributed import comm
    from zerotron.parallel.tensor.layers import full_tensor
    from zerotron.parallel.tensor.transform import (
        clip_grad_norm_tp,
        gather_logits,
        load_dense_into_tp,
        sync_replicated_grads,
        tp_loss_sum,
        tp_state_dict_full,
    )
    V, C = CFG["vocab_size"], CFG["n_embd"]
    for sp in (False, True):
        dense, tp = _models(g, sp)
        idx, tgt = _batch(torch.Generator().manual_seed(5))
        ref_logits = dense(idx)
        ref = F.cross_entropy(ref_logits.view(-1, V), tgt.view(-1), reduction="sum")
        ref.backward()
        comm.STATS.reset()
        logits = tp(idx)
        assert logits.shape == (B, T, -(-V // n))
        loss = tp_loss_sum(tp, logits, tgt)
        loss.backward()
        ln_local = tp.transformer.h[0].ln_1.weight.grad.clone()
        sync_replicated_grads(tp)
        calls = {k: v for k, v in comm.STATS.calls.items() if v}
        assert calls == _expected_calls(CFG["n_layer"], sp), f"sp={sp}: {calls}"
        act = B * T * C * 4
        op = "reduce_scatter" if sp else "all_reduce"
        assert comm.STATS.total_bytes(op, "tp", "tp_block") == 2 * CFG["n_layer"] * act
        if sp:  # without the sync each rank's LayerNorm gradient is only its shard's share
            assert not torch.allclose(ln_local, dense.transformer.h[0].ln_1.weight.grad, atol=1e-5)
        _close(gather_logits(logits, V, g), ref_logits.detach(), f"logits sp={sp}")
        _close(loss, ref.detach(), f"loss sp={sp}", atol=1e-4)
        dense_params = dict(dense.named_parameters())
        assert [k for k, _ in tp.named_parameters()] == list(dense_params)
        for name, p in tp.named_parameters():
            _close(full_tensor(p, g, p.grad), dense_params[name].grad, f"grad {name} sp={sp}")
        ref_norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in dense.parameters()]))
        assert abs(clip_grad_norm_tp(tp.parameters(), 0.0, g) - float(ref_norm)) <= 1e-5 * float(ref_norm)

        # a few AdamW steps with clipping on the same data: the full state dict follows the dense one
        opt_d, opt_t = (torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (dense, tp))
        gen = torch.Generator().manual_seed(9)
        for _ in range(3):
            idx, tgt = _batch(gen)
            for m, opt in ((dense, opt_d), (tp, opt_t)):
                opt.zero_grad()
                if m is dense:
                    F.cross_entropy(m(idx).view(-1, V), tgt.view(-1), reduction="sum").div(B * T).backward()
                    nd = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                else:
                    tp_loss_sum(m, m(idx), tgt).div(B * T).backward()
                    sync_replicated_grads(m)
                    nt = clip_grad_norm_tp(m.parameters(), 0.5, g)
                opt.step()
            assert abs(nt - float(nd)) <= 1e-4 * float(nd)
        full, ref_sd = tp_state_dict_full(tp), dense.state_dict()
        assert list(full) == list(ref_sd) and full["lm_head.weight"] is full["transformer.wte.weight"]
        for k in ref_sd:
            _close(full[k], ref_sd[k], f"after steps {k} sp={sp}", rtol=1e-4, atol=2e-5)
        wte = tp.transformer.wte
        assert not wte.weight[max(0, V - wte.vocab_start):].any(), "padded vocab rows must stay zero"

        # resharding: a differently seeded TP model loads the dense weights exactly
        _, other = _models(g, sp, seed=1)
        load_dense_into_tp(other, ref_sd)
        for k, v in tp_state_dict_full(other).items():
            assert torch.equal(v, ref_sd[k]), k
        with pytest.raises(KeyError):
            load_dense_into_tp(other, {k: v for k, v in ref_sd.items() if k != "transformer.ln_f.bias"})

        # generation through the KV cache (local heads), past block_size (re-prefill), SP switched off
        dense.eval(), tp.eval()
        prompt = torch.tensor([[1, 2, 3]])
        assert torch.equal(tp.generate(prompt, 15, temperature=0), dense.generate(prompt, 15, temperature=0))
        out_t = tp.generate(prompt, 6, top_k=10, generator=torch.Generator().manual_seed(3))
        assert torch.equal(out_t, dense.generate(prompt, 6, top_k=10, generator=torch.Generator().manual_seed(3)))
        assert tp.sequence_parallel == sp and not tp.parallel_hooks.full_logits

    # errors: tp must divide n_head; SP needs T divisible by tp
    with pytest.raises(ValueError, match="must divide model.n_head"):
        _models(g, False, n_head=n + 1, n_embd=8 * (n + 1))
    _, tp = _models(g, True)
    with pytest.raises(ValueError, match="T divisible by tp"):
        tp(torch.zeros(1, n + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="already tensor-parallel"):
        from zerotron.parallel.tensor.transform import apply_tensor_parallel
        apply_tensor_parallel(tp, g)


def _check_dropout(g, n, r):
    """dropout > 0: replicated parameters stay bitwise equal across tp ranks over training steps even
    though rank 1 draws extra numbers from the default generator between steps."""
    from zerotron.parallel.tensor.layers import is_tp_sharded
    from zerotron.parallel.tensor.transform import sync_replicated_grads, tp_loss_sum
    for sp in (False, True):
        _, tp = _models(g, sp, dropout=0.2)
        opt = torch.optim.AdamW(tp.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(4)
        for step in range(3):
            if r == 1:
                torch.rand(17 + step)
            idx, tgt = _batch(gen)
            opt.zero_grad()
            loss = tp_loss_sum(tp, tp(idx), tgt)
            loss.backward()
            sync_replicated_grads(tp)
            opt.step()
        tp.eval()
        with torch.no_grad():
            assert not torch.equal(tp_loss_sum(tp, tp(idx), tgt), loss.detach()), "dropout inactive?"
        rep = torch.cat([p.detach().reshape(-1) for p in tp.parameters() if not is_tp_sharded(p)])
        sharded = [p for p in tp.parameters() if is_tp_sharded(p)]
        assert rep.numel() and sharded
        rows = [torch.empty_like(rep) for _ in range(n)]
        torch.distributed.all_gather(rows, rep, group=g.pg)
        assert all(torch.equal(rows[0], x) for x in rows), f"replicated params differ across tp (sp={sp})"
        states = {k: [torch.empty_like(v) for _ in range(n)] for k, v in tp.tp_rng_tracker.states.items()}
        for k, out in states.items():
            torch.distributed.all_gather(out, tp.tp_rng_tracker.states[k], group=g.pg)
        assert all(torch.equal(states[REPLICATED][0], x) for x in states[REPLICATED])
        assert not torch.equal(states[MODEL_PARALLEL][0], states[MODEL_PARALLEL][1])


def _worker():
    import time

    from zerotron.distributed.mesh import Mesh, ParallelDims
    n = torch.distributed.get_world_size()
    mesh = Mesh(ParallelDims(n, tp=n), torch.device("cpu"))
    g, r = mesh.group("tp"), mesh.local_rank("tp")
    times = {}
    for check in (_check_layers, _check_model, _check_dropout):
        t0 = time.perf_counter()
        check(g, n, r)
        times[check.__name__] = round(time.perf_counter() - t0, 2)
    return times


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_dense(tp):
    times = run_ranks(_worker, tp)
    assert len(times) == tp


def test_rng_tracker_fork_leaves_default_stream_alone():
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL, 7)
    with pytest.raises(ValueError):
        tracker.add(MODEL_PARALLEL, 8)
    torch.manual_seed(0)
    expected_default = torch.rand(6)
    torch.manual_seed(0)
    a = torch.rand(3)
    with tracker.fork(MODEL_PARALLEL):
        x = torch.rand(4)
    with tracker.fork(MODEL_PARALLEL):
        y = torch.rand(4)
    b = torch.rand(3)
    assert torch.equal(torch.cat([a, b]), expected_default)
    ref = torch.rand(8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([x, y]), ref)
    with pytest.raises(KeyError):
        with tracker.fork("nope"):
            pass


def test_tp1_is_the_dense_model(single_process):
    """A tp group of one rank: no collectives, logits bitwise equal to the dense model's."""
    import torch.distributed as dist

    from zerotron.distributed import comm
    from zerotron.parallel.tensor.transform import apply_tensor_parallel, tp_loss_sum, tp_state_dict_full
    g = comm.NamedGroup(dist.group.WORLD, "tp")
    dense, tp = _models(g, True)
    idx, tgt = _batch(torch.Generator().manual_seed(0))
    comm.STATS.reset()
    logits = tp(idx)
    assert torch.equal(logits, dense(idx))
    loss = tp_loss_sum(tp, logits, tgt)
    _close(loss, F.cross_entropy(dense(idx).view(-1, CFG["vocab_size"]), tgt.view(-1), reduction="sum"), "loss")
    assert comm.STATS.total_calls() == 0
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in tp_state_dict_full(tp).items())
    assert isinstance(apply_tensor_parallel(GPT(GPTConfig(**CFG)), g), GPT)
