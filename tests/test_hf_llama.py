"""HF Llama import/export checked against transformers' LlamaForCausalLM as an independent model
(tiny random configs built offline, n_kv_head < n_head), plus the llama CLI smoke: train ->
generate -> export -> transformers, and init_from the export."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotron.models import registry
from zerotron.models.hf_llama import (
    export_hf_llama,
    hf_config_to_llama,
    llama_to_hf_config,
    load_hf_llama,
    state_dict_from_hf_llama,
    state_dict_to_hf_llama,
)
from zerotron.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")
VOCAB = 101
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8}


def redraw(model, scale=0.1):
    """Non-trivial norms and weights large enough that e.g. a wrong RoPE half or kv-head order
    changes the logits far beyond 1e-5."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + scale * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return model.eval()


def tiny_hf_model(seed=0, scaling=None, tie=False, theta=10000.0):
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=tie,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return redraw(transformers.LlamaForCausalLM(config))


def ids(n=24):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("scaling, theta", [(None, 10000.0), (L3, 500000.0)], ids=["rope", "llama3-scaling"])
def test_import_logits_and_round_trip_bitwise(tmp_path, report, scaling, theta):
    hf = tiny_hf_model(scaling=scaling, theta=theta)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_llama(tmp_path / "hf")
    assert ours.config.n_kv_head == 2 < ours.config.n_head and ours.config.rope_scaling == (
        None if scaling is None else {**scaling})
    with torch.no_grad():
        diff = (hf(ids()).logits - ours(ids())).abs().max().item()
        # incremental decoding with RoPE positions from the cache, against transformers' own cache
        ref = hf.generate(ids(6), max_new_tokens=10, do_sample=False, pad_token_id=VOCAB - 1)
    report(f"llama vs transformers logits ({'llama3 scaling' if scaling else 'plain rope'}): max |diff| {diff:.3g}")
    assert diff <= 1e-5
    assert torch.equal(ours.generate(ids(6), 10, temperature=0), ref)
    # HF -> zerotron -> HF: every tensor bitwise, the config fields transformers reads equal
    out = export_hf_llama(ours, None, tmp_path / "back")
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    again = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    for key in ("hidden_size", "intermediate_size", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
                "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(again.config, key) == getattr(hf.config, key), key
    assert torch.equal(again.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, hf(ids()).logits)


def test_tied_export_and_import(tmp_path):
    torch.manual_seed(1)
    ours = redraw(Llama(LlamaConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_kv_head=1,
                                    n_embd=32, intermediate_size=40, tie_word_embeddings=True, rope_scaling=L3)))
    out = export_hf_llama(ours, None, tmp_path / "export", eos_token_id=7)
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 7
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert (hf(ids()).logits - ours(ids())).abs().max().item() <= 1e-5
    back = registry.load_hf(out)  # family from config.json
    assert isinstance(back, Llama) and back.lm_head.weight is back.model.embed_tokens.weight
    for (name, t), u in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(t, u), name


def test_config_mapping_legacy_form_and_unsupported():
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      intermediate_size=48, rope_theta=500000.0, rope_scaling=dict(L3), dropout=0.1)
    hf_cfg = llama_to_hf_config(cfg)
    assert hf_config_to_llama(hf_cfg) == cfg and hf_cfg["bos_token_id"] is None
    legacy = {k: v for k, v in hf_cfg.items() if k != "rope_parameters"}  # transformers 4.x form
    assert hf_config_to_llama(legacy) == cfg
    v5 = {k: v for k, v in hf_cfg.items() if k not in ("rope_theta", "rope_scaling")}
    assert hf_config_to_llama(v5) == cfg
    assert hf_config_to_llama({**legacy, "rope_scaling": {**L3, "rope_type": None, "type": "llama3"}}) == cfg
    assert hf_config_to_llama({"num_attention_heads": 8, "hidden_size": 64}).n_kv_head == 8
    for bad, msg in (({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
                     ({"mlp_bias": True}, "mlp_bias"), ({"head_dim": 16}, "head_dim"),
                     ({"model_type": "mistral"}, "model_type"),
                     ({"hidden_size": ...}, "hidden_size absent from config.json"),
                     ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "'yarn'"),
                     ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'")):
        with pytest.raises(ValueError, match=msg):
            hf_config_to_llama({k: v for k, v in {**hf_cfg, **bad}.items() if v is not ...})  # ...: key removed


def test_load_errors(tmp_path):
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                      intermediate_size=24)
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(llama_to_hf_config(cfg)))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_llama(d)
    wide = LlamaConfig(**{**cfg.__dict__, "n_kv_head": 2})
    save_file(state_dict_to_hf_llama(Llama(wide).state_dict(), wide), str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*wrong shape.*k_proj"):
        load_hf_llama(d)
    sd = state_dict_to_hf_llama(Llama(cfg).state_dict(), cfg)
    del sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*up_proj"):
        state_dict_from_hf_llama(sd, cfg)
    # bare LlamaModel keys and an old rotary buffer are accepted
    full = state_dict_to_hf_llama(Llama(cfg).state_dict(), cfg)
    bare = {k.removeprefix("model."): v for k, v in full.items()}
    bare["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    assert state_dict_from_hf_llama(bare, cfg).keys() == Llama(cfg).state_dict().keys()
    tied = LlamaConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        state_dict_from_hf_llama({**full, "lm_head.weight": full["lm_head.weight"] + 1}, tied)
    with pytest.raises(ValueError, match="needs cfg"):
        export_hf_llama(Llama(cfg).state_dict(), None, tmp_path / "x")
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        registry.load_hf(d)


@pytest.mark.parametrize("index,message", [
    (b"{", r"model\.safetensors\.index\.json is not valid JSON"),  # was: "model.safetensors: Expecting ..."
    (b'{"metadata": {}}', "has no weight_map of tensor names"),  # was: the bare KeyError "'weight_map'"
    (b"[1]", "has no weight_map of tensor names"),
    (b'{"weight_map": {"a": "../elsewhere.safetensors"}}', "has no weight_map of tensor names"),
    # was: "No such file or directory: .../model-2.safetensors", naming neither the index nor the fix
    (b'{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}',
     r"shard model-2\.safetensors listed in .*index\.json is missing"),
], ids=["torn", "no-map", "list", "outside", "missing-shard"])
@pytest.mark.parametrize("meta", [True, False], ids=["headers", "weights"])
def test_sharded_index_errors_name_the_index(tmp_path, index, message, meta):
    """A sharded checkpoint whose model.safetensors.index.json is torn, has no weight_map, or lists a
    shard that is not there: one line naming the index (and the shard), from the launcher's header
    check (meta) and from the load itself."""
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                      intermediate_size=24)
    (tmp_path / "config.json").write_text(json.dumps(llama_to_hf_config(cfg)))
    save_file(state_dict_to_hf_llama(Llama(cfg).state_dict(), cfg), str(tmp_path / "model-1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as e:
        load_hf_llama(tmp_path, meta=meta)
    assert len(str(e.value).splitlines()) == 1


def test_cli_train_generate_export_init_from(tmp_path, data_cache):
    """The real CLI on configs/llama_tiny.toml: train a few steps (dense, one process), generate from
    the checkpoint, export it; transformers' logits equal the checkpoint's model, and a run started
    with model.init_from the export begins from exactly those weights."""
    from zerotron.cli import main
    from zerotron.generate import load_model, resolve_checkpoint
    from zerotron.train.checkpoint import read_meta

    run, out, run2 = tmp_path / "run", tmp_path / "hf", tmp_path / "run2"
    common = ["--train.eval_every", "0", "--log.progress", "false", "--log.plot", "false",
              "--data.cache_dir", data_cache]
    assert main(["train", "--config", "configs/llama_tiny.toml", "--run-dir", str(run), "--train.steps", "3",
                 "--log.sample_tokens", "8", *common]) == 0
    meta = read_meta(resolve_checkpoint(run))
    assert meta["model_config"]["arch"] == "llama" and meta["model_config"]["n_kv_head"] == 2
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]
    from zerotron.config import ConfigError, load_config
    from zerotron.train.setup import check_resume

    check_resume(load_config("configs/llama_tiny.toml"), run)
    with pytest.raises(ConfigError, match="arch llama .checkpoint. vs gpt2 .now."):
        check_resume(load_config("configs/tiny.toml"), run)  # same sizes, other family
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "5"]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    ours, tok, _ = load_model(run, torch.device("cpu"))
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([tok.encode("ROMEO: What say you?").ids])
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max().item() <= 1e-5
    assert main(["train", "--config", "configs/llama_tiny.toml", "--run-dir", str(run2), "--train.steps", "1",
                 "--model.init_from", str(out), "--data.tokenizer", str(out / "tokenizer.json"),
                 "--log.sample_tokens", "0", "--checkpoint.save_final", "true", "--train.lr", "1e-12",
                 "--train.warmup_steps", "0", "--train.min_lr", "0", *common]) == 0
    again, _, meta2 = load_model(run2, torch.device("cpu"))
    assert meta2["model_config"]["arch"] == "llama"
    for (name, t), u in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.allclose(t, u, atol=1e-9), name  # one step at lr 1e-12 from the export
