"""``model.init_from`` a Hugging Face directory zerotron cannot load exactly (issue 35): refused by
the launcher (or the single process) before any worker, lock or run directory -- one line, exit 2.
The layout rules (tp divides the kv heads) hold against the checkpoint's own config.json."""
import json

import pytest

from zerotron.cli import main
from zerotron.models.hf_llama import export_hf_llama
from zerotron.models.llama import Llama, LlamaConfig

COMMON = ["--config", "configs/llama_tiny.toml", "--train.steps", "2", "--train.eval_every", "0",
          "--log.progress", "false", "--log.plot", "false", "--log.sample_tokens", "0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HF Llama export with one key/value head (vocab 512, 4 heads of 16)."""
    cfg = LlamaConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_kv_head=1, n_embd=64,
                      intermediate_size=128).validate()
    return export_hf_llama(Llama(cfg), None, tmp_path_factory.mktemp("hf") / "base")


def _variant(src, dst, changes):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    c = json.loads((src / "config.json").read_text())
    if changes is None:
        c = {"model_type": "llama"}  # HF's defaults: the Llama-2-7B shape
    elif isinstance(changes, dict):
        c.update(changes)
    else:
        c = changes
    (dst / "config.json").write_text(c.decode() if isinstance(c, bytes) else json.dumps(c))  # bytes: as they are
    return dst


LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("name,changes,extra,message", [
    ("rope-linear", {"rope_scaling": LINEAR, "rope_parameters": {**LINEAR, "rope_theta": 1e4}}, [],
     "RoPE type 'linear'"),
    ("rope-yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, [],
     "RoPE type 'yarn'"),
    ("attention-bias", {"attention_bias": True}, [], "attention_bias=true"),
    ("mlp-bias", {"mlp_bias": True}, [], "mlp_bias=true"),
    ("gelu", {"hidden_act": "gelu"}, [], "hidden_act='gelu'"),
    ("head-dim", {"head_dim": 32}, [], "head_dim=32"),
    ("no-type", {"model_type": "bert"}, [], "model_type 'bert' is not supported"),
    ("tp2-one-kv-head", {}, ["--nproc", "2", "--parallel.tp", "2"], "parallel.tp (2) must divide model.n_kv_head (1)"),
    ("small-vocab", {}, ["--nproc", "2"], "vocab_size 100 < the tokenizer's 512"),
    # transformers reads a legacy rope_scaling beside a default rope_parameters as that scaling
    ("legacy-rope-linear", {"rope_scaling": LINEAR}, [], "RoPE type 'linear'"),
    ("rope-disagree", {"rope_scaling": LINEAR, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, [],
     "rope_parameters ('yarn') and rope_scaling ('linear') disagree"),
    ("rope-string", {"rope_scaling": "linear", "rope_parameters": None}, [], "rope_scaling must be a dict"),
    ("rope-theta-inf", {"rope_theta": float("inf"), "rope_parameters": None}, [], "rope_theta=inf"),
    ("zero-heads", {"num_attention_heads": 0}, ["--nproc", "2"], "cannot be loaded"),
    # config.json that does not describe the weights: found from the safetensors header alone
    ("more-layers", {"num_hidden_layers": 3}, ["--nproc", "2"], "model.layers.2."),
    ("wider", {"intermediate_size": 256}, [], "mlp.gate_proj.weight: got (128, 64), expected (256, 64)"),
    ("defaults-only", None, ["--nproc", "2"], "does not match the model config"),
    ("json-list", [1, 2], ["--nproc", "2"], "must hold a JSON object, got list"),
    # a config.json that is not JSON names the file (was only "Expecting property name ... (char 2)")
    ("json-broken", b"{\n", [], "config.json is not valid JSON (Expecting property name"),
])
def test_unloadable_init_from_refused_in_one_line(hf_dir, tmp_path, data_cache, capsys, name, changes, extra,
                                                  message):
    src = _variant(hf_dir, tmp_path / name, changes) if changes != {} else hf_dir
    if name == "small-vocab":  # weights and config agree, the tokenizer has more ids
        cfg = LlamaConfig(vocab_size=100, block_size=64, n_layer=2, n_head=4, n_kv_head=1, n_embd=64,
                          intermediate_size=128).validate()
        src = export_hf_llama(Llama(cfg), None, tmp_path / name)
    run = tmp_path / "run"
    code = main(["train", *COMMON, "--run-dir", str(run), "--model.init_from", str(src),
                 "--data.cache_dir", data_cache, *extra])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("zerotron: error: ") and message in lines[0], err
    if changes != {} and name != "small-vocab":
        assert str(src) in lines[0] and "model.init_from" in lines[0]
    assert not run.exists()  # no lock, no run directory


def test_loadable_init_from_shape_drives_the_plan(hf_dir, tmp_path):
    """The checkpoint's heads, not the config file's, decide the layout: llama_tiny has 2 kv heads
    (tp 2 fits) but the checkpoint has 1 (refused); a config without init_from still plans tp 2."""
    from zerotron.config import ConfigError, load_config
    from zerotron.plan import build_plan

    cfg = load_config("configs/llama_tiny.toml", [("parallel.tp", "2")])
    assert build_plan(cfg, 2).tp == 2
    with pytest.raises(ConfigError, match="from its config.json"):
        build_plan(load_config("configs/llama_tiny.toml", [("parallel.tp", "2"), ("model.init_from", str(hf_dir))]), 2)
    assert build_plan(load_config("configs/llama_tiny.toml", [("model.init_from", str(hf_dir))]), 1).tp == 1
