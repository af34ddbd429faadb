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
