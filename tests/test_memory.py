"""ZeRO memory estimator, parameter count and FLOP formulas (pure arithmetic, no processes)."""

import json

import pytest

from zerotron.analysis.flops import gpt_num_params, training_flops_per_token
from zerotron.analysis.memory import GB, format_table, model_state_bytes, zero_table
from zerotron.analysis.memory_cli import memory_main


def _gb_totals(rows):
    return [round(r["total_bytes"] / GB, 1) for r in rows]


def test_seed_table_7b_fp32_adam_dp8():
    rows = zero_table(7 * 10**9, 8, "fp32", "adam")
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert _gb_totals(rows) == [112.0, 63.0, 38.5, 14.0]
    # exact bytes: 16, 8 + 8/8, 4 + 12/8, 16/8 bytes per parameter
    assert [r["total_bytes"] for r in rows] == [112 * GB, 63 * GB, 38_500_000_000, 14 * GB]


def test_zero_paper_figure1_bf16_mixed_adam_dp64():
    rows = zero_table(7_500_000_000, 64, "bf16-mixed", "adam")
    assert _gb_totals(rows) == [120.0, 31.4, 16.6, 1.9]
    psi, n = 7_500_000_000, 64
    # (2+2+K)Psi, 2Psi+2Psi+K*Psi/N, 2Psi+(2+K)Psi/N, (2+2+K)Psi/N with K = 12
    assert [r["total_bytes"] for r in rows] == [16 * psi, 4 * psi + 12 * psi // n,
                                                2 * psi + 14 * psi // n, 16 * psi // n]


def test_hand_computed_small_case_each_component():
    # Psi = 1000, N = 4, fp32 Adam: shard = 250 elements
    assert model_state_bytes(1000, 4, 0) == {"params_bytes": 4000, "grads_bytes": 4000,
                                             "optimizer_bytes": 8000, "total_bytes": 16000}
    assert model_state_bytes(1000, 4, 1) == {"params_bytes": 4000, "grads_bytes": 4000,
                                             "optimizer_bytes": 2000, "total_bytes": 10000}
    assert model_state_bytes(1000, 4, 2) == {"params_bytes": 4000, "grads_bytes": 1000,
                                             "optimizer_bytes": 2000, "total_bytes": 7000}
    assert model_state_bytes(1000, 4, 3) == {"params_bytes": 1000, "grads_bytes": 1000,
                                             "optimizer_bytes": 2000, "total_bytes": 4000}
    # bf16-mixed Adam, stage 2: 2*1000 + 2*250 + 12*250
    assert model_state_bytes(1000, 4, 2, "bf16-mixed")["total_bytes"] == 5500


def test_sgd_momentum():
    assert model_state_bytes(1000, 4, 0, "fp32", "sgd")["optimizer_bytes"] == 4000
    assert model_state_bytes(1000, 4, 1, "fp32", "sgd")["optimizer_bytes"] == 1000
    assert model_state_bytes(1000, 4, 0, "bf16-mixed", "sgd")["optimizer_bytes"] == 8000
    assert model_state_bytes(1000, 4, 3, "bf16-mixed", "sgd")["total_bytes"] == 250 * 12


def test_ceil_division_when_not_divisible():
    # 10 params over 3 ranks: each rank holds a padded shard of ceil(10/3) = 4 elements
    r = model_state_bytes(10, 3, 3, "fp32", "adam")
    assert r == {"params_bytes": 16, "grads_bytes": 16, "optimizer_bytes": 32,
                 "total_bytes": 64}
    assert model_state_bytes(7, 8, 3)["total_bytes"] == 16  # 1 element per rank
    assert model_state_bytes(9, 8, 1)["optimizer_bytes"] == 16  # ceil(9/8)=2 elements * 8
    # dp = 1 changes nothing, every stage equals stage 0
    assert len({model_state_bytes(123, 1, s)["total_bytes"] for s in range(4)}) == 1


@pytest.mark.parametrize("kwargs, word", [
    (dict(stage=4), "stage"), (dict(stage=-1), "stage"), (dict(dp=0), "dp"),
    (dict(dtype="fp16"), "bf16-mixed"), (dict(optimizer="adamw"), "sgd"),
    (dict(num_params=-5), "num_params"), (dict(num_params=1.5), "num_params"),
])
def test_bad_inputs_raise_naming_valid_values(kwargs, word):
    args = dict(num_params=100, dp=2, stage=1, dtype="fp32", optimizer="adam") | kwargs
    with pytest.raises(ValueError, match=word):
        model_state_bytes(**args)


def test_format_table_in_gb():
    text = format_table(zero_table(7 * 10**9, 8))
    lines = text.splitlines()
    assert len(lines) == 5 and "total GB" in lines[0]
    assert lines[1].split()[-1] == "112" and lines[3].split()[-1] == "38.5"


def test_memory_main_json(capsys):
    assert memory_main(["--params", "7e9", "--dp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == 7 * 10**9 and out["dp"] == 8
    assert out["dtype"] == "fp32" and out["optimizer"] == "adam"
    assert [s["total_bytes"] for s in out["stages"]] == [r["total_bytes"]
                                                         for r in zero_table(7 * 10**9, 8)]
    assert memory_main(["--params", "7.5e9", "--dp", "64", "--dtype", "bf16-mixed",
                        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["stages"][1]["total_bytes"] / GB, 1) == 31.4


def test_memory_main_text_and_errors(capsys):
    assert memory_main(["--params", "1000", "--dp", "4", "--optimizer", "sgd"]) == 0
    assert "total GB" in capsys.readouterr().out
    assert memory_main(["--params", "1000", "--dp", "0"]) == 2
    assert "dp" in capsys.readouterr().err
    assert memory_main(["--params", "1000", "--dp", "4", "--dtype", "fp8"]) == 2
    assert memory_main(["--dp", "4"]) == 2  # neither --model nor --params
    assert memory_main(["--params", "1.5", "--dp", "4"]) == 2
    assert memory_main(["--params", "0", "--dp", "4"]) == 2 and memory_main(["--params", "-5", "--dp", "4"]) == 2
    assert memory_main(["--params", "1e400", "--dp", "4"]) == 2  # inf: one line, not an OverflowError
    assert memory_main(["--model", "no-such-model", "--dp", "4"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_memory_main_model_preset(capsys):
    pytest.importorskip("torch")
    assert memory_main(["--model", "gpt2", "--dp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_params"] == 124_439_808


def test_gpt_num_params_gpt2_small_by_hand():
    v, c, t, l = 50257, 768, 1024, 12
    hand = v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c
    assert hand == 124_439_808
    assert gpt_num_params(12, 12, 768, 50257, 1024) == 124_439_808
    # no bias: per block 12C^2 + 2C (LayerNorm weights only), final LayerNorm C
    assert gpt_num_params(1, 1, 4, 10, 3, bias=False) == 40 + 12 + (12 * 16 + 8) + 4
    with pytest.raises(ValueError, match="divisible"):
        gpt_num_params(2, 3, 64, 100, 16)
    with pytest.raises(ValueError, match="n_layer"):
        gpt_num_params(0, 1, 64, 100, 16)


@pytest.mark.parametrize("preset, overrides", [("tiny", {}), ("tiny", {"bias": False}),
                                               ("small", {"vocab_size": 97})])
def test_gpt_num_params_matches_model(preset, overrides):
    gpt = pytest.importorskip("zerotron.models.gpt")
    cfg = gpt.preset_config(preset, **overrides)
    model = gpt.GPT(cfg)
    assert gpt_num_params(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size,
                          bias=cfg.bias) == model.num_params()


def test_training_flops_per_token():
    # 6N + 12*L*C*S (PaLM appendix B), GPT-2 small at S = 1024
    assert training_flops_per_token(124_439_808, 12, 768, 1024) == \
        6 * 124_439_808 + 12 * 12 * 768 * 1024
    assert training_flops_per_token(10, 1, 2, 3) == 60 + 72
    with pytest.raises(ValueError):
        training_flops_per_token(0, 1, 2, 3)


def test_hsdp_shards_the_state_over_the_shard_group_not_dp():
    # dp 8 = 2 replicas x 4 shards: every stage equals flat ZeRO on 4 ranks, never on 8
    for stage in (0, 1, 2, 3):
        assert model_state_bytes(1000, 8, stage, dp_replicate=2) == model_state_bytes(1000, 4, stage)
    assert model_state_bytes(1000, 8, 3, dp_replicate=8) == model_state_bytes(1000, 1, 3)  # pure replication
    assert model_state_bytes(7 * 10**9, 16, 3, dp_replicate=2)["total_bytes"] == 14 * GB  # 16 bytes x Psi / 8
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="dp_replicate"):
            model_state_bytes(1000, 8, 3, dp_replicate=bad)


def test_memory_main_dp_replicate(capsys):
    assert memory_main(["--params", "7e9", "--dp", "16", "--dp-replicate", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dp_replicate"] == 2 and [r["total_bytes"] for r in out["stages"]][3] == 14 * GB
    assert memory_main(["--params", "7e9", "--dp", "16", "--dp-replicate", "3"]) == 2
    assert "dp_replicate" in capsys.readouterr().err


def test_cp_errors_name_the_one_problem(capsys):
    """--cp 0 / -2 and a --seq the zigzag split cannot cut each get one line naming only their problem
    (before: one message for both, ending in '--seq None' when no --seq was given)."""
    for argv, words, absent in ((["--cp", "0"], "--cp must be >= 1, got 0", "None"),
                                (["--cp", "-2"], "--cp must be >= 1, got -2", "None"),
                                (["--cp", "3", "--seq", "64"], "--seq 64 is not divisible by 2*cp = 6", "got --cp")):
        assert memory_main(["--model", "gpt2", "--dp", "2"] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and absent not in err[0], err
    # without cp any --seq within block_size is a training length (1023 was refused as "not divisible by 2*cp = 2")
    assert memory_main(["--model", "gpt2", "--dp", "2", "--seq", "1023", "--micro-batch", "1"]) == 0
