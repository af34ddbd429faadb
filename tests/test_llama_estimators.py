"""Estimators on Llama shapes: parameter counts against the real modules (meta device), per-rank
counts against the layout's own split, model-state bytes and saved activations measured on the
tiny config, KV cache bytes against a real cache, the planner's FLOP terms and the CLIs."""
import json

import pytest
import torch

from zerotron.analysis.activations import activation_bytes, layer_activation_bytes, measure_activation_bytes
from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.flops import llama_num_params, num_params, shape_of, training_flops_per_token
from zerotron.analysis.layout_cost import evaluate
from zerotron.analysis.memory import model_state_bytes, stage_num_params
from zerotron.analysis.memory_cli import memory_main
from zerotron.analysis.plan_cli import plan_main
from zerotron.analysis.planner import plan
from zerotron.models.layout import get_module
from zerotron.models.llama import Llama, LlamaConfig, preset_config
from zerotron.models.registry import preset_config as any_preset


@pytest.mark.parametrize("name, tie", [("llama-tiny", False), ("llama-tiny", True), ("llama3.2-1b", True),
                                       ("llama2-7b", False), ("llama3-8b", False), ("llama3-8b", True)])
def test_param_count_formula_equals_real_module(name, tie):
    cfg = preset_config(name, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = Llama(cfg)
    assert num_params(cfg) == model.num_params()
    assert llama_num_params(cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.intermediate_size,
                            cfg.vocab_size, tie) == model.num_params()
    assert shape_of(cfg).flop_params() == model.num_params(non_embedding=True)


def test_published_sizes():
    assert num_params(preset_config("llama3-8b")) == 8_030_261_248
    assert num_params(preset_config("llama2-7b")) == 6_738_415_616
    assert num_params(preset_config("llama3.2-1b")) == 1_235_814_400
    s = shape_of(preset_config("llama3-8b"))
    assert s.flop_params() == 8_030_261_248 - 128256 * 4096
    assert s.block_matmul_params() == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    # 6N + 12LCS at S = 8192 (torchtitan's count for Llama-3-8B: 6 * non-embedding N + 12 L H Q T)
    assert training_flops_per_token(s.flop_params(), 32, 4096, 8192) == 6 * 7_504_924_672 + 12 * 32 * 4096 * 8192


def _layout_count(model, tp, stages, pp):
    """Parameters of each pipeline rank's tp shard, derived from the model's own layout: block
    Linears in block_tp divided by tp, vocab-sized matrices ceil(V/tp) rows, the rest replicated."""
    lay, cfg = model.layout(), model.config
    blocks = get_module(model, lay.blocks)
    per_block = sum(p.numel() // tp if name.rsplit(".", 1)[0] in lay.block_tp else p.numel()
                    for name, p in blocks[0].named_parameters())
    vocab = -(-cfg.vocab_size // tp) * cfg.n_embd
    out = [n * per_block for n in stages]
    out[0] += vocab
    out[-1] += cfg.n_embd + (vocab if not cfg.tie_word_embeddings or pp > 1 else 0)
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_stage_params_match_the_layout_split(tie):
    model = Llama(preset_config("llama-tiny", tie_word_embeddings=tie))
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        assert stage_num_params(model.config, tp, pp) == _layout_count(model, tp, [4 // pp] * pp, pp), (tp, pp)
    with pytest.raises(ValueError, match="n_kv_head"):
        stage_num_params(model.config, tp=4)  # 4 query heads but 2 kv heads


def test_measured_model_state_bytes_dense_tiny(single_process):
    from zerotron.parallel.base import Strategy

    torch.manual_seed(0)
    model = Llama(preset_config("llama-tiny", vocab_size=512))
    strategy = Strategy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 512, (2, 16))).sum().backward()
    opt.step()
    measured = strategy.model_state_bytes(opt)
    est = model_state_bytes(num_params(model.config), 1, 0, "fp32")
    assert {k: measured[k] for k in est} == est


@pytest.mark.parametrize("b, s", [(2, 32), (2, 64)])
def test_measured_activations_match_estimate(b, s):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from zerotron.analysis.activations import measure_layer_activation_bytes

    torch.manual_seed(0)
    model = Llama(preset_config("llama-tiny", vocab_size=512)).train()
    idx = torch.randint(0, 512, (b, s))
    kw = dict(dtype="fp32", dropout=False, ffn=192, norm_saves=2, mlp_saves=4)
    measured = measure_layer_activation_bytes(model, idx)
    est = layer_activation_bytes(s, b, 64, 4, attention="flash", **kw)
    assert est == (24 + 64) * s * b * 64  # fp32: 6 replicated + 4 attention + 4 x 3h SwiGLU tensors
    assert len(set(measured)) == 1 and est <= measured[0] < 1.02 * est  # extras: rstd, logsumexp
    gpt_like = layer_activation_bytes(s, b, 64, 4, attention="flash", dtype="fp32", dropout=False)
    assert abs(measured[0] / gpt_like - 1) > 0.3  # the GPT-2 count would be far off
    with sdpa_kernel(SDPBackend.MATH):
        math = measure_layer_activation_bytes(model, idx)[0]
    est_math = layer_activation_bytes(s, b, 64, 4, **kw)
    assert abs(math / est_math - 1) < 0.10
    whole = activation_bytes(model.config, b, s, dtype="fp32", attention="flash")
    assert abs(measure_activation_bytes(model, idx, idx) / whole["max_bytes"] - 1) < 0.10
    assert whole["embedding_bytes"] == 0  # no embedding dropout in Llama


def test_kv_cache_bytes_equal_a_real_cache():
    from zerotron.models.base import KVCache

    model = Llama(preset_config("llama-tiny", vocab_size=512)).eval()
    cache = KVCache(4)
    with torch.no_grad():
        model(torch.randint(0, 512, (3, 20)), kv_cache=cache)
    real = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert shape_of(model.config).kv_cache_bytes(3, 20, 4) == real
    s = shape_of(preset_config("llama3-8b"))
    assert s.kv_cache_bytes(1, 8192, 2) == 2**30  # 128 KiB per token in bf16
    assert shape_of(preset_config("llama3-8b", n_kv_head=32)).kv_cache_bytes(1, 8192) == 4 * 2**30  # MHA


def test_planner_prices_llama_shapes():
    from zerotron.analysis.hardware import hardware

    cfg = any_preset("llama3-8b")
    h, L, V, S, F = 4096, 32, 128256, 8192, 14336
    cm = CostModel(hardware("h100"), compute_eff=0.5, launch_s=0.0)
    lay = dict(dp=8, tp=1, pp=1, zero_stage=3, schedule="none", micro_batch=2, recompute="none")
    r = evaluate(cfg, lay, S, 16, cm)
    W = 2 * h * h + 2 * h * 1024 + 3 * h * F
    flops = 2 * S * (L * (6 * W + 12 * h * S) + 6 * h * V)
    assert r["time_breakdown_s"]["compute"] == pytest.approx(flops / (989e12 * 0.5), rel=1e-12)
    tok = 16 * S
    assert r["predicted_mfu"] == pytest.approx((6 * (8_030_261_248 - V * h) + 12 * L * h * S) * tok
                                               / (r["predicted_step_time_s"] * 8 * 989e12))
    res = plan(cfg, 16, 80 * 10**9, 32, S, cm)
    assert res["layouts"] and all(x["tp"] <= 8 for x in res["layouts"])  # tp 16 > n_kv_head 8: dropped
    assert res["dropped"]["divisibility"] >= 1


def test_cli_memory_and_plan_for_llama3_8b(capsys):
    assert memory_main(["--model", "llama3-8b", "--dp", "8", "--dtype", "bf16-mixed", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == 8_030_261_248
    assert out["stages"][3]["total_bytes"] == 16 * 8_030_261_248 // 8
    assert memory_main(["--model", "llama3-8b", "--dp", "8", "--seq", "8192", "--micro-batch", "2", "--tp", "2",
                        "--sp", "--recompute", "full", "--json"]) == 0
    act = json.loads(capsys.readouterr().out)["activations"]
    assert act["kv_cache_bytes"] == 2**30 * 4 // 2 // 2 * 2  # fp32 cache, 2 sequences, tp 2
    assert memory_main(["--model", "llama3-8b", "--dp", "8", "--tp", "16"]) == 2
    assert "n_kv_head" in capsys.readouterr().err
    assert plan_main(["--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--seq", "8192",
                      "--json", "--top", "3"]) == 0
    top = json.loads(capsys.readouterr().out)["layouts"]
    assert len(top) == 3 and all(x["memory_bytes_per_gpu"] <= 80 * 10**9 for x in top)


def test_gqa_config_has_fewer_kv_params_than_mha():
    gqa, mha = (LlamaConfig(n_embd=256, n_head=8, n_kv_head=k, intermediate_size=512) for k in (2, 8))
    assert num_params(mha) - num_params(gqa) == 4 * 2 * 256 * (8 - 2) * 32


LAYOUTS_2 = {"dp2-zero3": {"parallel.zero_stage": 3}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}}


def _state_bytes(cache):
    """One optimizer step of llama-tiny per layout on this rank; its model-state bytes."""
    import tempfile

    from zerotron.testing import ROOT, tiny_config
    from zerotron.train.trainer import Trainer

    out = {}
    for name, lay in LAYOUTS_2.items():
        cfg = tiny_config({"train.steps": 1, "train.global_batch": 4, "train.micro_batch": 2, "train.eval_every": 1, "train.eval_batches": 1,
                           "checkpoint.save_final": "false", "log.tensorboard": "false", "data.cache_dir": cache,
                           **lay}, path=ROOT / "configs" / "llama_tiny.toml")
        with tempfile.TemporaryDirectory() as run:
            tr = Trainer(cfg, run)
            tr.fit()
            out[name] = tr.strategy.model_state_bytes(tr.optimizer)
            out[name + "/model"] = tr.model_cfg
    return out


def test_measured_model_state_bytes_three_layouts(data_cache):
    """Per-rank parameter + gradient + Adam bytes of a real llama-tiny run under dp2 ZeRO-3, tp2 and
    pp2 equal the estimators': the ZeRO formula (model_state_bytes) within the flat buffers' padding,
    and 16 bytes x the per-rank split of stage_num_params (fp32) exactly."""
    from zerotron.testing import run_ranks

    ranks = run_ranks(_state_bytes, 2, data_cache, join_timeout_s=300)
    cfg = ranks[0]["tp2/model"]
    n = num_params(cfg)
    for r, got in enumerate(ranks):
        est = model_state_bytes(n, 2, 3, "fp32")["total_bytes"]
        assert est <= got["dp2-zero3"]["total_bytes"] < 1.01 * est, (r, got["dp2-zero3"], est)
        assert got["tp2"]["total_bytes"] == 16 * stage_num_params(cfg, tp=2)[0], (r, got["tp2"])
        assert got["pp2"]["total_bytes"] == 16 * stage_num_params(cfg, pp=2)[r], (r, got["pp2"])
    print(f"\nllama-tiny model-state bytes per rank (measured / estimated): "
          f"dp2 ZeRO-3 {ranks[0]['dp2-zero3']['total_bytes']} / {model_state_bytes(n, 2, 3)['total_bytes']}, "
          f"tp2 {ranks[0]['tp2']['total_bytes']} / {16 * stage_num_params(cfg, tp=2)[0]}, "
          f"pp2 {[g['pp2']['total_bytes'] for g in ranks]} / {[16 * c for c in stage_num_params(cfg, pp=2)]}")
