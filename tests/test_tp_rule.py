"""The tensor-parallel divisibility rule is stated once (``zerotron.models.layout.tp_refusal``) and
every layer that decides it -- the plan, the model layout, the estimators, the planner, the CLIs --
refuses exactly the same tp degrees with the same reason."""
from types import SimpleNamespace

import pytest

from zerotron.analysis.activations import activation_bytes
from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.flops import shape_of
from zerotron.analysis.hardware import hardware
from zerotron.analysis.memory import stage_num_params
from zerotron.analysis.memory_cli import memory_main
from zerotron.analysis.planner import plan
from zerotron.config import ConfigError
from zerotron.models.layout import TP_SIZES, ModelLayout, TPLinear, tp_refusal
from zerotron.plan import ParallelDims, ParallelPlan

# (config, plan shape): GPT-2 (n_head 6), Llama with GQA (12 heads, 4 kv heads, SwiGLU 36),
# Llama with an MLP width that only 1 and 3 divide (n_head 6, kv 6, 27), one kv head (MQA)
SHAPES = {
    "gpt": dict(n_layer=4, n_head=6, n_embd=48, block_size=12, vocab_size=64),
    "llama-gqa": dict(n_layer=4, n_head=12, n_kv_head=4, n_embd=48, block_size=12, vocab_size=64,
                      intermediate_size=36),
    "llama-odd-ffn": dict(n_layer=4, n_head=6, n_kv_head=6, n_embd=48, block_size=10, vocab_size=64,
                          intermediate_size=27),
    "llama-mqa": dict(n_layer=4, n_head=4, n_kv_head=1, n_embd=32, block_size=8, vocab_size=64,
                      intermediate_size=64),
}
GPUS = 12  # tp in 1, 2, 3, 4, 6, 12 (gpus_per_node 1: every divisor is a mesh)


def _cfg(d):
    return SimpleNamespace(**{"bias": True, "dropout": 0.0, "tie_word_embeddings": False, **d})


def _plan_reason(d, tp, sp):
    try:
        ParallelPlan(dims=ParallelDims(tp, 1, tp), shape=d, sequence_parallel=sp)
    except ConfigError as e:
        return str(e)
    return None


def _raises(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("sp", [False, True])
def test_plan_estimators_and_planner_refuse_the_same_tp(name, sp):
    d = SHAPES[name]
    cfg = _cfg(d)
    shape = shape_of(cfg)
    seq = d["block_size"]
    tps = [t for t in range(1, GPUS + 1) if GPUS % t == 0]
    planned = plan(cfg, GPUS, 10**15, GPUS, seq, CostModel(hardware("h100"), gpus_per_node=1, sp=sp))
    planner_tps = {r["tp"] for r in planned["layouts"]}
    accepted = []
    for tp in tps:
        want = tp_refusal(tp, d, seq if sp else None)
        # (the plan refuses sequence_parallel at tp 1 by its own rule; the planner then prices no SP)
        assert _plan_reason(d, tp, sp and tp > 1) == want, (name, tp, sp)
        assert (_raises(lambda: activation_bytes(shape, 1, seq, tp=tp, sp=sp)) is None) == (want is None)
        # the per-rank parameter split does not depend on the sequence: the model sizes alone
        model_only = tp_refusal(tp, d)
        assert _raises(lambda: stage_num_params(shape, tp)) == model_only
        if want is None:
            accepted.append(tp)
    assert planner_tps == set(accepted), (name, sp, planner_tps, accepted)
    assert 1 in accepted and len(accepted) < len(tps)  # each shape refuses some tp


def test_layout_check_tp_is_the_same_rule():
    d = SHAPES["llama-gqa"]
    lay = ModelLayout(blocks="h", embedding=(), head=(), token_embedding="e", output="o",
                      block_tp={"q": TPLinear("column")}, attention="a", width=48, vocab_size=64,
                      tp_divides={k: d[k] for k in TP_SIZES})
    for tp in range(1, 13):
        assert _raises(lambda: lay.check_tp(tp)) == tp_refusal(tp, d)
    with pytest.raises(ValueError, match="tp_refusal"):
        ModelLayout(blocks="h", embedding=(), head=(), token_embedding="e", output="o", block_tp={},
                    attention="a", width=48, vocab_size=64, tp_divides={"n_experts": 8})


def test_reasons_are_one_line_and_name_setting_and_fix():
    d = SHAPES["llama-gqa"]
    assert tp_refusal(2, d) is None and tp_refusal(4, d, 12) is None
    r = tp_refusal(3, d)
    assert r == ("parallel.tp (3) must divide model.n_kv_head (4): each tp rank holds whole key/value heads "
                 "(they are split, not replicated); choose parallel.tp among 1, 2, 4")
    assert "model.n_head (12)" in tp_refusal(5, d)
    assert tp_refusal(4, d, 10) == ("parallel.sequence_parallel needs model.block_size (10) divisible by "
                                    "parallel.tp (4) (the sequence is split over the tp ranks): change one of "
                                    "them, or turn parallel.sequence_parallel off")
    assert "model.intermediate_size (27)" in tp_refusal(2, SHAPES["llama-odd-ffn"])
    assert tp_refusal(0, d) == "parallel.tp must be an int >= 1, got 0"
    for tp in range(1, 30):
        assert "\n" not in (tp_refusal(tp, d, 7) or "")


def test_memory_cli_names_its_options(capsys):
    assert memory_main(["--model", "llama3-8b", "--dp", "1", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerotron memory: error: --tp (3) must divide model.n_head (32)") and "\n" not in err
    assert memory_main(["--model", "gpt2", "--dp", "1", "--tp", "4", "--sp", "--seq", "30"]) == 2
    assert "--sp needs --seq (30) divisible by --tp (4)" in capsys.readouterr().err
