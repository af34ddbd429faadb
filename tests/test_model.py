"""Tests for zerotron.models.gpt: shapes, tying, init, KV cache, generation, errors."""
import pytest
import torch

from zerotron.models.gpt import GPT, PRESETS, GPTConfig, KVCache, preset_config

CFG = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)


def make_model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def test_shapes_and_split_pieces():
    model = make_model()
    idx = torch.randint(0, CFG.vocab_size, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, CFG.vocab_size)
    x = model.embed(idx)
    assert x.shape == (3, 10, CFG.n_embd)
    for block in model.transformer.h:
        x = block(x)
    assert torch.equal(model.head(x), logits)


def test_tied_weights_are_one_tensor():
    model = make_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # de-duplicated: counted/optimised once


def test_num_params_gpt2_preset():
    with torch.device("meta"):
        model = GPT(preset_config("gpt2"))
    assert model.num_params() == 124_439_808
    assert model.num_params(non_embedding=True) == 124_439_808 - 1024 * 768


def test_presets_and_errors():
    assert preset_config("tiny").n_embd == 64
    assert preset_config("small", dropout=0.1).dropout == 0.1
    assert set(PRESETS) >= {"tiny", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "7b"}
    with pytest.raises(ValueError, match="valid presets: tiny"):
        preset_config("nope")
    for bad in (dict(n_embd=30, n_head=4), dict(n_layer=0), dict(dropout=1.0),
                dict(dropout=-0.1), dict(vocab_size=-5)):
        with pytest.raises(ValueError, match="GPTConfig"):
            GPT(GPTConfig(**bad))


def test_init_deterministic_and_scaled():
    a, b = make_model(seed=3), make_model(seed=3)
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), na
    assert not torch.equal(a.transformer.wte.weight, make_model(seed=4).transformer.wte.weight)
    torch.manual_seed(0)
    big = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=4, n_embd=256))
    blk = big.transformer.h[0]
    fc_std = blk.mlp.c_fc.weight.std().item()
    proj_std = blk.mlp.c_proj.weight.std().item()
    assert abs(fc_std - 0.02) < 1e-3
    assert abs(proj_std - 0.02 / 4.0) < 5e-4  # 0.02 / sqrt(2 * 8)
    assert blk.attn.c_proj.weight.std().item() < 0.5 * fc_std
    assert torch.all(blk.attn.c_attn.bias == 0) and torch.all(blk.ln_1.weight == 1)


def test_kv_cache_matches_full_forward():
    model = make_model()
    idx = torch.randint(0, CFG.vocab_size, (2, 20))
    full = model(idx)
    cache = KVCache(CFG.n_layer)
    pieces = [model(idx[:, :7], kv_cache=cache)]  # prefill
    pieces.append(model(idx[:, 7:12], kv_cache=cache))  # several new tokens (explicit mask)
    for t in range(12, 20):  # one token at a time
        pieces.append(model(idx[:, t:t + 1], kv_cache=cache))
    assert len(cache) == 20
    assert cache.keys[1].shape == (2, CFG.n_head, 20, CFG.n_embd // CFG.n_head)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def naive_greedy(model, idx, n):
    for _ in range(n):
        logits = model(idx[:, -model.config.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def test_greedy_generate_deterministic_and_matches_naive():
    model = make_model()
    idx = torch.randint(0, CFG.vocab_size, (2, 5))
    out = model.generate(idx, 10, temperature=0)
    assert out.shape == (2, 15) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, model.generate(idx, 10, temperature=0))
    assert torch.equal(out, naive_greedy(model, idx, 10))
    # past block_size (32): the context is cropped like the naive loop
    long = model.generate(idx, 40, temperature=0)
    assert long.shape == (2, 45)
    assert torch.equal(long, naive_greedy(model, idx, 40))


def test_sampling_uses_generator_and_top_k():
    model = make_model()
    idx = torch.zeros(2, 3, dtype=torch.long)
    a = model.generate(idx, 8, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(idx, 8, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    top1 = model.generate(idx, 8, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(top1, model.generate(idx, 8, temperature=0))
    with pytest.raises(ValueError):
        model.generate(idx, 2, top_k=0)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CFG.__dict__, "dropout": 0.5}))
    idx = torch.randint(0, CFG.vocab_size, (2, 8))
    model.eval()
    assert torch.equal(model(idx), model(idx))
    model.train()
    assert not torch.equal(model(idx), model(idx))


def test_too_long_input_raises():
    model = make_model()
    with pytest.raises(ValueError, match="33 > block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = KVCache(CFG.n_layer)
    model(torch.zeros(1, 30, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="start_pos 30"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
