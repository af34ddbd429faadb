"""``--resume`` with other LoRA settings than the checkpoint's is refused in the launcher, in one
line, before any worker starts (it used to fail inside every worker's checkpoint load: exit 1,
five lines, torch elastic's error among them)."""
from pathlib import Path

import pytest

from zerotron.config import ConfigError
from zerotron.testing import tiny_config
from zerotron.train.setup import check_resume_lora

CKPT = Path("runs/x/checkpoints/step_4")


def test_lora_resume_mismatch_refused():
    cases = [({"lora_rank": 0, "lora_targets": ""}, {"train.lora_rank": 8},
              "train.lora_rank 0 (checkpoint 'runs/x/checkpoints/step_4') vs 8 (now)"),
             ({"lora_rank": 4, "lora_targets": ""}, {"train.lora_rank": 8}, "train.lora_rank 4 (checkpoint"),
             ({"lora_rank": 8, "lora_targets": ""}, {"train.lora_rank": 0}, "vs 0 (now)"),
             ({"lora_rank": 8, "lora_targets": ""}, {"train.lora_rank": 8, "train.lora_targets": "mlp.c_fc"},
              "train.lora_targets attn.c_attn,attn.c_proj (checkpoint 'runs/x/checkpoints/step_4') vs mlp.c_fc (now)")]
    for saved, over, message in cases:
        with pytest.raises(ConfigError) as e:
            check_resume_lora(tiny_config(over), saved, CKPT)
        assert message in str(e.value) and "\n" not in str(e.value) and "--model.init_from" in str(e.value)


def test_lora_resume_same_settings_pass():
    # the default targets spelled out equal "" (the attention projections); older checkpoints: not compared
    check_resume_lora(tiny_config({"train.lora_rank": 8, "train.lora_targets": "c_attn,attn.c_proj"}),
                      {"lora_rank": 8, "lora_targets": ""}, CKPT)
    check_resume_lora(tiny_config(), {"lora_rank": 0, "lora_targets": ""}, CKPT)
    check_resume_lora(tiny_config({"train.lora_rank": 8}), {}, CKPT)


def test_lora_on_mixtral_refused(capsys, tmp_path):
    """LoRA adapts dense projections only: a MoE model with train.lora_rank > 0 is one line, exit 2
    (it was a KeyError traceback from the plan's target check)."""
    from zerotron.cli import main

    code = main(["train", "--config", "configs/moe_tiny.toml", "--run-dir", str(tmp_path / "r"), "--nproc", "2",
                 "--train.lora_rank", "4"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not model.arch = 'mixtral'" in err, err
    assert not (tmp_path / "r").exists()


def test_init_from_damaged_safetensors_refused(capsys, tmp_path):
    """A model.init_from directory whose model.safetensors is truncated or overwritten at its header
    is one line, exit 2, before any worker starts (it was a SafetensorError traceback)."""
    import json

    import torch
    from safetensors.torch import save_file

    from zerotron.cli import main

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "n_positions": 64,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "activation_function": "gelu_new"}))
    save_file({"wte.weight": torch.zeros(512, 32)}, str(hf / "model.safetensors"))
    raw = (hf / "model.safetensors").read_bytes()
    for damaged in (raw[:40], b"\xff" * 16 + raw[16:]):
        (hf / "model.safetensors").write_bytes(damaged)
        code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--nproc", "2",
                     "--model.init_from", str(hf)])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "not a readable safetensors file, truncated or damaged" in err and "Traceback" not in err, err
        assert not (tmp_path / "r").exists()
