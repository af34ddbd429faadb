"""HF GPT-2 import/export checked against transformers' GPT2LMHeadModel as an independent model."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotron.models.gpt import GPT, GPTConfig
from zerotron.models.hf import (
    export_hf_gpt2,
    gpt_to_hf_config,
    hf_config_to_gpt,
    load_hf_gpt2,
    state_dict_from_hf,
    state_dict_to_hf,
)

transformers = pytest.importorskip("transformers")
VOCAB = 101


def redraw(model, scale=0.1):
    """Re-draw every parameter: non-trivial biases/LayerNorms (so their mapping is tested) and
    weights large enough that e.g. exact-vs-tanh GELU changes the logits by ~5e-4 >> 1e-5."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1 + scale * torch.randn_like(p))
            else:
                p.normal_(0.0, scale)
    return model.eval()


def tiny_hf_model(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return redraw(transformers.GPT2LMHeadModel(config))


def ids(n=12):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))


def test_import_matches_hf_logits(tmp_path):
    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path)
    ours = load_hf_gpt2(tmp_path)
    assert not ours.training and ours.config.block_size == 32 and ours.config.vocab_size == VOCAB
    with torch.no_grad():
        expected = hf(ids()).logits
        got = ours(ids())
    assert (got - expected).abs().max().item() <= 1e-5
    # a .safetensors path with config.json beside it works too
    again = load_hf_gpt2(tmp_path / "model.safetensors")
    assert torch.equal(again(ids()), got)


def test_export_loads_in_transformers(tmp_path):
    torch.manual_seed(1)
    ours = redraw(GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32)))
    out = export_hf_gpt2(ours, None, tmp_path / "export")
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        diff = (hf(ids()).logits - ours(ids())).abs().max().item()
    assert diff <= 1e-5
    # round trip through our loader is exact
    back = load_hf_gpt2(out)
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_export_refuses_non_empty_dir(tmp_path):
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16))
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf_gpt2(model, None, tmp_path)
    export_hf_gpt2(model, None, tmp_path, overwrite=True)
    assert (tmp_path / "config.json").is_file()
    # every exported file has the mode open() gives (0644 under the usual umask), weights included
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.name != "keep.txt"}
    assert modes["model.safetensors"] == modes["config.json"] == (tmp_path / "keep.txt").stat().st_mode & 0o777, modes
    with pytest.raises(ValueError, match="needs cfg"):
        export_hf_gpt2(model.state_dict(), None, tmp_path / "other")


def test_state_dict_conversion_prefix_buffers_and_transpose():
    cfg = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    hf_sd = state_dict_to_hf(model.state_dict(), cfg)
    w = model.transformer.h[0].attn.c_attn.weight
    assert torch.equal(hf_sd["transformer.h.0.attn.c_attn.weight"], w.t())
    assert hf_sd["transformer.h.0.attn.c_attn.weight"].data_ptr() != w.data_ptr()
    # GPT2Model-style keys (no prefix) plus old mask buffers
    bare = {k.removeprefix("transformer."): v for k, v in hf_sd.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    bare["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    sd = state_dict_from_hf(bare, cfg)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    for name, t in model.state_dict().items():
        assert torch.equal(sd[name], t), name


def test_config_mapping_and_unsupported():
    cfg = GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    hf_cfg = gpt_to_hf_config(cfg)
    # no tokenizer given and a vocabulary without GPT-2's id: no ordinary token is taken for eos
    assert hf_cfg["bos_token_id"] is None and hf_cfg["eos_token_id"] is None
    assert gpt_to_hf_config(cfg, eos_token_id=7)["eos_token_id"] == gpt_to_hf_config(cfg, 7)["bos_token_id"] == 7
    for bad in (VOCAB, -1, True):
        with pytest.raises(ValueError, match="eos_token_id"):
            gpt_to_hf_config(cfg, eos_token_id=bad)
    assert hf_config_to_gpt(hf_cfg) == cfg
    assert gpt_to_hf_config(GPTConfig(vocab_size=50257))["eos_token_id"] == 50256
    legacy = {k: v for k, v in hf_cfg.items() if k != "n_positions"}
    assert hf_config_to_gpt({**legacy, "n_ctx": 64}).block_size == 64
    for bad, msg in (({"activation_function": "relu"}, "activation_function"),
                     ({"scale_attn_by_inverse_layer_idx": True}, "inverse_layer_idx"),
                     ({"reorder_and_upcast_attn": True}, "reorder_and_upcast"),
                     ({"n_inner": 100}, "n_inner"), ({"tie_word_embeddings": False}, "tie")):
        with pytest.raises(ValueError, match=msg):
            hf_config_to_gpt({**hf_cfg, **bad})
    with pytest.raises(ValueError, match="bias"):
        gpt_to_hf_config(GPTConfig(bias=False))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        load_hf_gpt2(tmp_path / "does_not_exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_gpt2(empty)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16)
    (empty / "config.json").write_text(json.dumps(gpt_to_hf_config(cfg)))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_gpt2(empty)
    # weights from a wider model than config.json says
    wide = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=24)
    save_file(state_dict_to_hf(GPT(wide).state_dict(), wide), str(empty / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*wrong shape"):
        load_hf_gpt2(empty)
    # a missing layer
    sd = state_dict_to_hf(GPT(cfg).state_dict(), cfg)
    del sd["transformer.h.0.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="missing.*c_fc.bias"):
        state_dict_from_hf(sd, cfg)


def test_export_cli_eos_is_the_tokenizers_endoftext(tmp_path, data_cache):
    """``zerotron export`` of a trained checkpoint (vocab < 50257) writes the tokenizer's
    <|endoftext|> id as bos/eos: transformers' greedy generate() then equals our greedy decoding
    cut after the first end-of-text, and stops exactly there when that token comes."""
    import copy

    from zerotron.cli import main
    from zerotron.data import load_tokenizer
    from zerotron.data.tokenizer import EOT
    from zerotron.generate import load_model

    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--config", "configs/tiny.toml", "--run-dir", str(run), "--train.steps", "1",
                 "--model.n_layer", "1", "--train.eval_every", "0", "--log.progress", "false",
                 "--log.sample_tokens", "0", "--log.plot", "false", "--data.cache_dir", data_cache]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    ours, tok, _ = load_model(run, torch.device("cpu"))
    eot = load_tokenizer(out / "tokenizer.json").token_to_id(EOT)
    assert eot == tok.token_to_id(EOT) and ours.config.vocab_size < 50257
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((out / name).read_text())
        assert ids["bos_token_id"] == ids["eos_token_id"] == eot, (name, ids)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.generation_config.eos_token_id == eot
    prompt = torch.tensor([tok.encode("ROMEO:").ids])
    n = 12
    with torch.no_grad():
        got = hf.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=eot)[0, prompt.size(1):].tolist()
        ref = ours.generate(prompt, n, temperature=0.0)[0, prompt.size(1):].tolist()
    cut = ref[:ref.index(eot) + 1] if eot in ref else ref
    assert got == cut and len(got) > 1, (got, ref)
    # a model whose every next token is <|endoftext|>: generate() stops after exactly that token
    forced = copy.deepcopy(hf)
    with torch.no_grad():
        wte = forced.transformer.wte.weight
        v = torch.zeros_like(wte[eot])
        v[0] = 100 * wte.norm(dim=1).max()
        wte[eot] = v  # tied: the lm_head row of <|endoftext|> too
        forced.transformer.ln_f.weight.zero_()
        forced.transformer.ln_f.bias.copy_(v)
        stopped = forced.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=eot)
    assert stopped[0, prompt.size(1):].tolist() == [eot]
