"""Activation-memory formulas (Korthikanti et al. 2022), pipeline occupancy, and measured saved
tensors of the real GPT on CPU against the estimate."""

import json

import pytest

from zerotron.analysis.activations import (
    _cap,
    _in_flight_states,
    activation_bytes,
    layer_activation_bytes,
    stage_layer_counts,
)
from zerotron.analysis.memory import GB, model_state_bytes
from zerotron.analysis.memory_cli import memory_main
from zerotron.models.gpt import GPTConfig, preset_config

# GPT-3-like shape of the paper's examples: s=2048, h=12288, a=96, t=8, b=1 -> as/h = 16
S, H, A, T = 2048, 12288, 96, 8
SBH = S * 1 * H  # 25,165,824


@pytest.mark.parametrize("kwargs, factor", [
    (dict(), 34 + 5 * 16),                                   # no parallelism: sbh(34 + 5as/h)
    (dict(tp=T), 10 + 24 / 8 + 5 * 16 / 8),                  # tp: sbh(10 + 24/t + 5as/(ht)) = 23
    (dict(tp=T, sp=True), 34 / 8 + 5 * 16 / 8),              # tp + sp: 14.25
    (dict(tp=T, sp=True, recompute="selective"), 34 / 8),    # selective drops 5as/h: 4.25
    (dict(tp=T, recompute="selective"), 10 + 24 / 8),        # 13
    (dict(tp=T, recompute="full"), 2),                       # full: the layer input 2sbh
    (dict(tp=T, sp=True, recompute="full"), 2 / 8),          # ... divided by t with SP
    (dict(recompute="selective"), 34),
])
def test_paper_formulas_gpt3_shape(kwargs, factor):
    got = layer_activation_bytes(S, 1, H, A, dtype="bf16", dropout=True, **kwargs)
    assert got == int(factor * SBH)


def test_hand_values_and_reductions():
    # exact bytes for the four headline cases at t = 8
    assert layer_activation_bytes(S, 1, H, A, tp=8) == 578_813_952
    assert layer_activation_bytes(S, 1, H, A, tp=8, sp=True) == 358_612_992
    assert layer_activation_bytes(S, 1, H, A, tp=8, sp=True, recompute="selective") == 106_954_752
    assert layer_activation_bytes(S, 1, H, A, tp=8, sp=True, recompute="full") == 6_291_456
    base = layer_activation_bytes(S, 2, H, A)
    assert base == 2 * layer_activation_bytes(S, 1, H, A)  # linear in micro-batch
    for t in (2, 4, 8):
        no_sp, sp = (layer_activation_bytes(S, 1, H, A, tp=t, sp=x) for x in (False, True))
        assert sp * t == layer_activation_bytes(S, 1, H, A)  # SP divides everything by t
        assert no_sp - 10 * SBH == (base // 2 - 10 * SBH) // t  # all but 10sbh divided by t


def test_fp32_and_dropout_variants():
    s, b, h, a = 64, 2, 64, 4
    sbh, as2b = s * b * h, a * s * s * b
    # fp32 with 1-byte masks: 2-byte terms doubled, masks unchanged: sbh*66 + 9*a*s^2*b
    assert layer_activation_bytes(s, b, h, a, dtype="fp32") == 66 * sbh + 9 * as2b
    # no dropout: no masks, the dropout output is its input: 64sbh + 4as^2b (fp32), 32sbh + 2as^2b
    assert layer_activation_bytes(s, b, h, a, dtype="fp32", dropout=False) == 64 * sbh + 4 * as2b
    assert layer_activation_bytes(s, b, h, a, dropout=False) == 32 * sbh + 2 * as2b
    # CPU dropout keeps fp32 masks: 4-byte masks -> 72sbh + 12as^2b
    assert layer_activation_bytes(s, b, h, a, dtype="fp32", mask_bytes=4) == 72 * sbh + 12 * as2b
    # flash attention: no s^2 term, so selective recompute saves nothing more
    flash = layer_activation_bytes(s, b, h, a, dtype="fp32", dropout=False, attention="flash")
    assert flash == 64 * sbh == layer_activation_bytes(s, b, h, a, dtype="fp32", dropout=False,
                                                       attention="flash", recompute="selective")
    assert layer_activation_bytes(s, b, h, a, dtype="fp32", recompute="full") == 4 * sbh


@pytest.mark.parametrize("kwargs, word", [
    (dict(tp=3), "tp"), (dict(tp=4, sp=True, seq_len=66), "seq_len"),
    (dict(recompute="some"), "recompute"), (dict(dtype="fp8"), "dtype"),
    (dict(attention="sdpa"), "attention"), (dict(micro_batch=0), "micro_batch"),
])
def test_layer_bad_inputs(kwargs, word):
    args = dict(seq_len=64, micro_batch=1, hidden=64, heads=4) | kwargs
    with pytest.raises(ValueError, match=word):
        layer_activation_bytes(**args)


def _cfg(**kw):
    return GPTConfig(**({"vocab_size": 1000, "block_size": 128, "n_layer": 8, "n_head": 4,
                         "n_embd": 64} | kw)).validate()


def test_pipeline_in_flight_multiplication():
    from zerotron.parallel.pipeline.schedules import build_schedule
    from zerotron.parallel.pipeline.simulation import simulate

    cfg, s, b = _cfg(), 128, 2
    layer = layer_activation_bytes(s, b, 64, 4, dropout=False)
    sbh = s * b * 64
    out = 2 * 2 * sbh + 4 * s * b * 1000  # final LN + head input (bf16) + fp32 log-softmax
    # 1F1B, pp=4, m=8: rank r holds pp - r micro-batches of 2 layers; rank 0 = L layers' worth
    r = activation_bytes(cfg, b, s, pp=4, microbatches=8)
    assert r["peak_in_flight"] == [4, 3, 2, 1] and r["layers_per_stage"] == [2, 2, 2, 2]
    assert r["per_rank_bytes"][:3] == [4 * 2 * layer, 3 * 2 * layer, 2 * 2 * layer]
    assert r["per_rank_bytes"][3] == 2 * layer + out and r["output_bytes"] == out
    assert r["per_rank_bytes"][0] == cfg.n_layer * layer and r["worst_rank"] == 0
    # GPipe holds every micro-batch on every rank
    g = activation_bytes(cfg, b, s, pp=4, schedule="gpipe", microbatches=8)
    assert g["per_rank_bytes"][0] == 8 * 2 * layer and g["peak_in_flight"] == [8] * 4
    # interleaved v=2: units are (micro-batch, chunk) of L/(pp v) layers, counted by simulate
    i = activation_bytes(cfg, b, s, pp=2, schedule="interleaved", microbatches=4, virtual_stages=2)
    sim = simulate(build_schedule(2, 4, "interleaved", 2), 2, 2).peak_in_flight
    assert i["peak_in_flight"] == sim and i["per_rank_bytes"][0] == sim[0] * 2 * layer
    # pp = 1: one micro-batch in flight whatever m; embedding dropout mask with dropout on
    one = activation_bytes(_cfg(dropout=0.1), b, s, microbatches=8)
    layer_d = layer_activation_bytes(s, b, 64, 4)
    assert one["embedding_bytes"] == sbh  # 1-byte mask
    assert one["per_rank_bytes"] == [8 * layer_d + sbh + out]
    # full recompute: checkpoints of every layer + one layer re-materialised during backward
    full = activation_bytes(cfg, b, s, recompute="full")
    assert full["recompute_workspace_bytes"] == layer - 2 * sbh
    assert full["per_rank_bytes"] == [8 * 2 * sbh + out + layer - 2 * sbh]


def test_pipeline_errors_and_stage_counts():
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]
    from zerotron.parallel.pipeline.executor import stage_layer_counts as exec_counts
    assert all(stage_layer_counts(n, k) == exec_counts(n, k) for n in (4, 7, 12) for k in (1, 3, 4))
    with pytest.raises(ValueError, match="pipeline stages"):
        activation_bytes(_cfg(), 1, 64, pp=16, microbatches=16)
    with pytest.raises(ValueError, match="microbatches % pp"):
        activation_bytes(_cfg(), 1, 64, pp=4, schedule="interleaved", microbatches=6,
                         virtual_stages=2)
    with pytest.raises(ValueError, match="block_size"):
        activation_bytes(_cfg(), 1, 256)


def test_capped_simulation_matches_full_schedule():
    def maximal(states):
        return {s for s in states if not any(o != s and all(x >= y for x, y in zip(o, s))
                                             for o in states)}
    for pp in (2, 3, 4):
        for v, kind in ((1, "1f1b"), (2, "interleaved"), (3, "interleaved")):
            for m in (pp * k for k in range(1, 7)):
                full, capped = (_in_flight_states(pp, n, kind, v) for n in (m, _cap(pp, m, kind, v)))
                assert full[0] == capped[0]
                assert [maximal(x) for x in full[1]] == [maximal(x) for x in capped[1]]


# ---- measured saved tensors of the real model (fp32, CPU) ----

torch = pytest.importorskip("torch")


def _model(dropout=0.0):
    from zerotron.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(preset_config("tiny", dropout=dropout)).train()


@pytest.mark.parametrize("b, s", [(2, 32), (4, 64)])
def test_measured_per_layer_matches_fp32_estimate(b, s):
    from zerotron.analysis.activations import measure_layer_activation_bytes

    model = _model()
    idx = torch.randint(0, 8192, (b, s))
    measured = measure_layer_activation_bytes(model, idx)
    # dropout 0 on CPU: SDPA takes the flash kernel (no s^2 term), fp32 activations
    est = layer_activation_bytes(s, b, 64, 4, dtype="fp32", dropout=False, attention="flash")
    assert len(set(measured)) == 1 and abs(measured[0] / est - 1) < 0.10
    assert measured[0] >= est  # only small uncounted extras (LN mean/rstd, logsumexp)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the paper's kernel: softmax output saved
        math = measure_layer_activation_bytes(model, idx)[0]
    est_math = layer_activation_bytes(s, b, 64, 4, dtype="fp32", dropout=False)
    assert est_math > est and abs(math / est_math - 1) < 0.10


def test_measured_with_dropout_and_whole_model():
    from zerotron.analysis.activations import measure_activation_bytes, measure_layer_activation_bytes

    b, s = 2, 32
    idx = torch.randint(0, 8192, (b, s))
    dropped = _model(0.1)
    per_layer = measure_layer_activation_bytes(dropped, idx)[0]
    # dropout > 0: math kernel, and CPU dropout saves fp32 masks (4 bytes per element)
    est = layer_activation_bytes(s, b, 64, 4, dtype="fp32", attention="math", mask_bytes=4)
    assert abs(per_layer / est - 1) < 0.10
    assert measure_layer_activation_bytes(dropped.eval(), idx)[0] < per_layer  # no masks in eval
    plain = _model()
    forward_only = measure_activation_bytes(plain, idx)
    layers = measure_layer_activation_bytes(plain, idx)
    assert forward_only - sum(layers) < 8192 * 64 * 4 // 4  # the tied 2 MB weight is excluded
    with_loss = measure_activation_bytes(plain, idx, idx)
    whole = activation_bytes(plain.config, b, s, dtype="fp32", attention="flash")["max_bytes"]
    assert abs(with_loss / whole - 1) < 0.10


def test_memory_main_activation_options(capsys):
    argv = ["--model", "gpt2", "--dp", "4", "--dtype", "bf16-mixed", "--seq", "1024",
            "--micro-batch", "2", "--tp", "2", "--sp", "--pp", "2", "--microbatches", "4",
            "--recompute", "selective", "--json"]
    assert memory_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    act = out["activations"]
    cfg = preset_config("gpt2")
    assert act["per_layer_bytes"] == layer_activation_bytes(1024, 2, 768, 12, tp=2, sp=True,
                                                            recompute="selective", dropout=False)
    assert act["per_rank_bytes"] == activation_bytes(
        cfg, 2, 1024, tp=2, sp=True, pp=2, microbatches=4, recompute="selective")["per_rank_bytes"]
    assert [r["stage"] for r in act["totals"]] == [0, 1, 2, 3]
    for row, stage in zip(act["totals"], out["stages"]):
        assert row["total_bytes"] == row["model_state_bytes"] + row["activation_bytes"]
        assert row["model_state_bytes"] <= stage["total_bytes"]  # stages: the largest rank
    assert out["num_params"] == 124_439_808 and out["stages"][0]["total_bytes"] < 16 * 124_439_808
    # text mode shows both and the old table
    assert memory_main(["--model", "gpt2", "--dp", "2", "--seq", "512"]) == 0
    text = capsys.readouterr().out
    assert "activ. GB" in text and "total GB" in text
    row0 = [ln for ln in text.splitlines() if ln.split()[:2] == ["0", "0"]][0].split()
    states = model_state_bytes(124_439_808, 2, 0)["total_bytes"]
    assert float(row0[2]) == pytest.approx(states / GB, rel=1e-3)
    # without --seq: the old output, unchanged
    assert memory_main(["--model", "gpt2", "--dp", "2", "--json"]) == 0
    assert "activations" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [
    ["--params", "1e9", "--dp", "2", "--seq", "1024"],            # needs a model shape
    ["--model", "gpt2", "--dp", "2", "--seq", "1024", "--tp", "5"],  # 5 does not divide 12 heads
    ["--model", "gpt2", "--dp", "2", "--seq", "4096"],            # longer than block_size
    ["--model", "gpt2", "--dp", "2", "--seq", "1024", "--recompute", "half"],
])
def test_memory_main_activation_errors(argv, capsys):
    assert memory_main(argv) == 2
    assert capsys.readouterr().err
