"""Attention dropout under context parallelism (issue 28): the mask is a pure function of global
coordinates (``zerotron.models.attn_dropout``), so every cp implementation drops exactly what one
process drops with the same key.

(a) kernels: ring (zigzag), a2a and allgather over cp 2, MHA and GQA, with and without document
    masks, forward and dq/dk/dv in fp64 against one process's ``coordinate_attention``;
(a') whole models (GPT-2 and Llama, every impl) with attention-probability dropout only: cp 2 logits
    and cp-summed gradients equal one process running with the coordinate mask forced;
(c) activation checkpointing: a cp 2 model with every dropout on gives bitwise the gradients of the
    same model without recomputation (the recompute regenerates the masks);
(b) a training witness, statistical: embedding and residual dropout act on each rank's local tokens
    with its own RNG stream, so cp 2 with dropout 0.1 trains *like* one process, not bitwise
    (``ZEROTRON_CP_FULL=1``: two trainings).
One spawn of 2 ranks runs (a), (a') and (c)."""
import os

import pytest
import torch

from zerotron.testing import run_ranks, tiny_config

B, T, D = 2, 16, 8
P = 0.3
IMPLS = ("ring", "a2a", "allgather")


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _kernel(group, impl, H, Hkv, docs, seed, key_shift=0):
    """Errors (out, dq, dk, dv) of cp attention with dropout P against one process."""
    from zerotron.models.attn_dropout import AttnDropout, coordinate_attention
    from zerotron.parallel.context.attention import context_attention
    from zerotron.parallel.context.documents import doc_attention
    from zerotron.parallel.context.split import split_sequence

    cp, rank = group.size(), group.rank()
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    doc = torch.cumsum((torch.rand(B, T, generator=gen) < 0.2).long(), 1) if docs else None
    drop = AttnDropout(P, 987654321 + seed)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    t = torch.arange(T)
    if doc is None:
        out = coordinate_attention(*ref, t[None, :] <= t[:, None], drop, t, t)
    else:
        out = doc_attention(*ref, doc, drop=drop)
    out.backward(dout)
    want = [out.detach()] + [x.grad for x in ref]
    loc = [split_sequence(x, cp, rank, dim=2).clone().requires_grad_() for x in (q, k, v)]
    mine = AttnDropout(P, drop.key + key_shift)
    got = context_attention(*loc, group, impl, doc=doc, drop=mine)
    got.backward(split_sequence(dout, cp, rank, dim=2))
    return [_rel(g, split_sequence(w, cp, rank, dim=2)) for g, w in zip([got.detach()] + [x.grad for x in loc], want)]


def _model(arch, impl_or_none, group, seed=0, attention_only=True):
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.models.llama import Llama, LlamaConfig
    from zerotron.parallel.context.transform import apply_context_parallel

    torch.manual_seed(seed)
    if arch == "gpt":
        model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=4, n_embd=32, dropout=P))
    else:
        model = Llama(LlamaConfig(vocab_size=64, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                  intermediate_size=48, dropout=P))
    model = model.double().train()
    if attention_only:  # embedding and residual dropout draw from local RNG streams: take them out
        for name, m in list(model.named_modules()):
            if isinstance(m, torch.nn.Dropout):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], torch.nn.Identity())
    if impl_or_none is not None:
        apply_context_parallel(model, group, impl_or_none)
    return model


def _grads(model, x, w, rng_seed):
    """Logits and parameter gradients of sum(logits * w) with the RNG seeded ``rng_seed``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    logits = model(x)
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _models(group):
    """(a') cp 2 model with attention dropout vs one process (coordinate mask forced)."""
    from zerotron.distributed import comm
    from zerotron.models.attn_dropout import coordinate_dropout
    from zerotron.parallel.context.split import split_sequence

    cp, rank = group.size(), group.rank()
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (B, T), generator=gen)
    w = torch.randn(B, T, 64, generator=gen, dtype=torch.float64)
    res = {}
    for arch in ("gpt", "llama"):
        with coordinate_dropout():
            ref_logits, ref_grads = _grads(_model(arch, None, group), x, w, 11)
        undropped = _grads(_model(arch, None, group).eval(), x, w, 11)[0]
        for impl in IMPLS:
            comm.STATS.reset()
            logits, grads = _grads(_model(arch, impl, group), split_sequence(x, cp, rank),
                                   split_sequence(w, cp, rank), 11)
            keys = comm.STATS.bytes.get(("broadcast", "cp", "cp_dropout"), 0)
            for g in grads.values():
                comm.all_reduce(g, group=group)  # the batch group (here cp) sums the gradients
            err = max([_rel(logits, split_sequence(ref_logits, cp, rank))]
                      + [_rel(grads[n], ref_grads[n]) for n in ref_grads])
            res[(arch, impl)] = {"err": err, "key_bytes": keys}
        res[(arch, "dropped")] = _rel(split_sequence(undropped, cp, rank), split_sequence(ref_logits, cp, rank))
    return res


def _recompute(group):
    """(c) every dropout on (attention coordinate masks, local residual/embedding masks), cp 2 ring
    and a2a: full activation checkpointing gives bitwise the gradients of no recomputation."""
    from zerotron.parallel.context.split import split_sequence
    from zerotron.parallel.recompute import apply_activation_checkpointing

    cp, rank = group.size(), group.rank()
    gen = torch.Generator().manual_seed(6)
    x = split_sequence(torch.randint(0, 64, (B, T), generator=gen), cp, rank)
    w = split_sequence(torch.randn(B, T, 64, generator=gen, dtype=torch.float64), cp, rank)
    res = {}
    for arch, impl in (("gpt", "ring"), ("llama", "a2a")):
        model = _model(arch, impl, group, attention_only=False)
        _, plain = _grads(model, x, w, 21 + rank)
        _, other = _grads(model, x, w, 22 + rank)  # another RNG state: other masks (the check can fail)
        apply_activation_checkpointing(model, "full")
        _, again = _grads(model, x, w, 21 + rank)
        res[(arch, impl)] = {"recompute": max(_rel(again[n], plain[n]) for n in plain),
                             "other_seed": max(_rel(other[n], plain[n]) for n in plain)}
    return res


def _all():
    import torch.distributed as dist

    from zerotron.distributed.comm import NamedGroup

    group = NamedGroup(dist.group.WORLD, "cp")
    res = {}
    for impl in IMPLS:
        for H, Hkv in ((4, 4), (4, 2)):
            for docs in (False, True):
                res[(impl, H, Hkv, docs)] = _kernel(group, impl, H, Hkv, docs, 100 * H + 10 * Hkv + docs)
    res["wrong_key"] = _kernel(group, "ring", 4, 2, False, 3, key_shift=1)  # the comparison can fail
    res["models"] = _models(group)
    res["recompute"] = _recompute(group)
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout_s=120)


def test_kernels_equal_one_process(results):
    """(a) ring, a2a, allgather with dropout (MHA, GQA, ± documents): out and dq/dk/dv, fp64."""
    worst = max(max(v) for res in results for k, v in res.items() if isinstance(k, tuple))
    assert worst <= 1e-10, worst
    assert min(results[0]["wrong_key"]) > 1e-3, results[0]["wrong_key"]  # another key: other masks


def test_models_equal_one_process(results):
    """(a') GPT-2 and Llama, every impl, attention dropout: cp 2 = one process with the coordinate
    mask, one 8-byte key broadcast per attention call (2 layers)."""
    for res in results:
        m = res["models"]
        for arch in ("gpt", "llama"):
            assert m[(arch, "dropped")] > 1e-3  # dropout changes the logits
            for impl in IMPLS:
                assert m[(arch, impl)]["err"] <= 1e-10, (arch, impl, m[(arch, impl)])
                assert m[(arch, impl)]["key_bytes"] == 2 * 8


def test_recompute_regenerates_masks(results):
    """(c) activation checkpointing with dropout under cp: the same gradients, bitwise."""
    for res in results:
        for case, r in res["recompute"].items():
            assert r["recompute"] == 0.0, (case, r)
            assert r["other_seed"] > 1e-3, (case, r)


def test_keep_mask_is_a_coordinate_function():
    """Blocks of the mask equal slices of the whole; the kept fraction is 1 - p; keys differ."""
    from zerotron.models.attn_dropout import keep_mask

    a = torch.arange
    whole = keep_mask(123, 0.1, a(4), a(8), a(128), a(128))
    block = keep_mask(123, 0.1, a(1, 3), a(2, 6), a(64, 96), a(32, 64))
    assert torch.equal(block, whole[1:3, 2:6, 64:96, 32:64])
    assert abs(whole.float().mean().item() - 0.9) < 0.01
    other = keep_mask(124, 0.1, a(4), a(8), a(128), a(128))
    assert abs((whole != other).float().mean().item() - 2 * 0.1 * 0.9) < 0.01  # independent keys
    assert keep_mask(123, 0.0, a(2), a(2), a(4), a(4)).all()
    with pytest.raises(ValueError):
        keep_mask(1, 1.0, a(1), a(1), a(1), a(1))


def test_forced_switch(monkeypatch):
    """causal_attention keeps torch's fused dropout unless the coordinate mask is forced (context
    manager or ZEROTRON_ATTN_DROPOUT=coordinate); forced, it equals coordinate_attention."""
    from zerotron.models.attn_dropout import AttnDropout, coordinate_attention, coordinate_dropout, draw_key
    from zerotron.models.base import causal_attention

    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    t = torch.arange(8)
    torch.manual_seed(3)
    want = coordinate_attention(q, k, v, t[None, :] <= t[:, None], AttnDropout(0.2, draw_key()), t, t)
    for ctx in ("manager", "env"):
        torch.manual_seed(3)
        if ctx == "env":
            monkeypatch.setenv("ZEROTRON_ATTN_DROPOUT", "coordinate")
            got = causal_attention(q, k, v, 0.2)
        else:
            with coordinate_dropout():
                got = causal_attention(q, k, v, 0.2)
        assert torch.equal(got, want), ctx
    with coordinate_dropout(False):
        torch.manual_seed(3)
        assert not torch.equal(causal_attention(q, k, v, 0.2), want)  # torch's own mask


def _fit(overrides, run_dir):
    from zerotron.train.trainer import Trainer

    tr = Trainer(tiny_config(overrides), run_dir)
    losses = []
    tr.fit(callback=lambda t, rec: losses.append(rec["loss"]))
    msd, _ = tr.strategy.state_dict(tr.optimizer)
    return {"losses": losses, "params": {k: v.detach().double().cpu().numpy().copy() for k, v in msd.items()}}


@pytest.mark.skipif(os.environ.get("ZEROTRON_CP_FULL") != "1", reason="~50-100 s on 2 cores: make test-cp")
def test_training_witness_statistical(tmp_path, data_cache, single_process):
    """(b) cp 2 (ring) with model.dropout 0.1 against one process with dropout 0.1, 4 fp64 steps.
    Statistical, not exact: attention masks are coordinate functions, but embedding and residual
    dropout draw from each rank's stream over its local tokens (and the attention keys come from
    streams that those draws advance), so the masks differ from one process's. Checks: cp replicas
    bitwise equal, the losses within 1 % of one process's (measured: 0.3 % at most), and not equal
    to them (dropout is on). Two trainings: ``ZEROTRON_CP_FULL=1`` (``make test-cp``); the default
    suite has the exact model-level check (``test_models_equal_one_process``)."""
    base = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 16,
            "model.dropout": 0.1, "train.steps": 4, "train.global_batch": 4, "train.micro_batch": 2,
            "train.eval_every": 0, "checkpoint.save_final": "false", "checkpoint.every": 0,
            "train.dtype": "fp64", "log.tensorboard": "false", "data.cache_dir": data_cache}
    ranks = run_ranks(_fit, 2, {**base, "parallel.cp": 2}, str(tmp_path / "cp2"), timeout_s=120)
    for k, v in ranks[0]["params"].items():
        assert (v == ranks[1]["params"][k]).all(), k
    one = _fit(base, str(tmp_path / "one"))
    cp2 = ranks[0]["losses"]
    assert len(cp2) == len(one["losses"]) == 4
    assert cp2 != one["losses"]
    print("cp2 / one-process losses (dropout 0.1):", cp2, one["losses"])
    for a, b in zip(cp2, one["losses"]):
        assert abs(a - b) <= 0.01 * b, (cp2, one["losses"])
