"""The Mixtral-style MoE family (``zerotron.models.mixtral``, its layer ``zerotron.models.moe``): routing,
auxiliary losses and their gradient, HF ``MixtralForCausalLM`` interop, config and plan refusals. Layouts: test_moe_parity.py."""
import json

import pytest
import torch
import torch.nn.functional as F

from zerotron.cli import main
from zerotron.config import ConfigError
from zerotron.models import registry
from zerotron.models.hf_mixtral import export_hf_mixtral, hf_config_to_mixtral
from zerotron.models.mixtral import Mixtral, MixtralConfig
from zerotron.models.moe import MoE, set_step_rows, take_router_stats
from zerotron.plan import build_plan
from zerotron.testing import tiny_config

SMALL = dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=24,
             rope_theta=1e6)


def test_routing_rules_and_dropless():
    """topk_softmax = softmax over the k largest logits (Mixtral); softmax_topk keeps the raw top-k
    probabilities; every token reaches exactly k distinct experts; the output is the weighted sum of
    the chosen experts' SwiGLU outputs, computed here token by token."""
    torch.manual_seed(0)
    for router in ("topk_softmax", "softmax_topk"):
        cfg = MixtralConfig(**SMALL, n_experts=4, experts_top_k=2, moe_router=router, moe_shared_intermediate_size=16)
        moe = MoE(cfg).double().eval()
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(3, 5, cfg.n_embd, dtype=torch.float64)
        out = moe(x)
        h = x.reshape(-1, cfg.n_embd)
        logits = moe.gate(h)
        want = torch.zeros_like(h)
        e = moe.experts
        for t in range(h.size(0)):
            top, idx = torch.topk(logits[t], 2)
            w = F.softmax(top, -1) if router == "topk_softmax" else F.softmax(logits[t], -1)[idx]
            for j, i in enumerate(idx.tolist()):
                y = (F.silu(e.gate_proj[i] @ h[t]) * (e.up_proj[i] @ h[t])) @ e.down_proj[i].t()
                want[t] += w[j] * y
        want += moe.shared_expert(h)
        torch.testing.assert_close(out.reshape(-1, cfg.n_embd), want, rtol=1e-12, atol=1e-12)


def test_aux_losses_enter_the_gradient_exactly():
    """The gradient the model's injected auxiliary losses produce equals that of the explicit
    objective CE + a * mean_l E*sum(f*P) + z * mean_l mean(logsumexp^2), computed here from the
    router logits; and the recorded stats are those values (fp64)."""
    torch.manual_seed(1)
    a, zc = 0.3, 0.05
    cfg = MixtralConfig(**SMALL, n_experts=4, experts_top_k=2, moe_aux_loss_coef=a, moe_z_loss_coef=zc)
    m = Mixtral(cfg).double().train()
    x, y = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
    ce = lambda logits: F.cross_entropy(logits.reshape(-1, 61), y.reshape(-1))  # noqa: E731
    ce(m(x)).backward()
    injected = {n: p.grad.clone() for n, p in m.named_parameters()}
    stats = take_router_stats(m, cfg.n_layer, cfg.n_experts)
    m.zero_grad()
    logged = []
    hooks = [b.mlp.gate.register_forward_hook(lambda mod, i, o: logged.append(o)) for b in m.model.layers]
    for b in m.model.layers:
        b.mlp.aux_coef = b.mlp.z_coef = 0.0
    loss = ce(m(x))
    aux, z = [], []
    for logits in logged:
        probs = F.softmax(logits, -1)
        counts = torch.bincount(torch.topk(logits, 2).indices.reshape(-1), minlength=4).double()
        aux.append(4 * (counts / logits.size(0) * probs.mean(0)).sum())
        z.append(torch.logsumexp(logits, -1).square().mean())
    (loss + a * torch.stack(aux).mean() + zc * torch.stack(z).mean()).backward()
    for h in hooks:
        h.remove()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, injected[n], rtol=1e-10, atol=1e-14, msg=n)
    assert injected["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    torch.testing.assert_close(stats[:, -2], torch.stack(aux).detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(stats[:, -1], torch.stack(z).detach(), rtol=1e-12, atol=0)
    assert stats[:, :-2].sum(1).tolist() == [24 * 2] * cfg.n_layer  # N tokens x k assignments per layer


def test_aux_losses_per_micro_batch_in_one_forward():
    """A forward over two micro-batches concatenated (the naive pipeline's flush) takes the
    auxiliary losses per micro-batch of ``micro_rows`` rows: gradients and recorded stats equal two
    forwards of one micro-batch each; without ``micro_rows`` (f_i, P_i over both) they differ."""
    torch.manual_seed(2)
    cfg = MixtralConfig(**SMALL, n_experts=4, experts_top_k=2, moe_aux_loss_coef=0.3, moe_z_loss_coef=0.05)
    m = Mixtral(cfg).double().train()
    x, y = torch.randint(0, 61, (4, 12)), torch.randint(0, 61, (4, 12))

    def run(parts, micro):
        set_step_rows(m, 4, micro)
        m.zero_grad()
        for i, j in parts:
            F.cross_entropy(m(x[i:j]).reshape(-1, 61), y[i:j].reshape(-1), reduction="sum").backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}, take_router_stats(m, cfg.n_layer, cfg.n_experts)

    split, s_split = run([(0, 2), (2, 4)], 2)
    joined, s_joined = run([(0, 4)], 2)
    whole, _ = run([(0, 4)], None)
    for n in split:
        torch.testing.assert_close(joined[n], split[n], rtol=1e-10, atol=1e-13, msg=n)
    torch.testing.assert_close(s_joined, s_split, rtol=1e-12, atol=1e-15)
    gate = "model.layers.0.mlp.gate.weight"
    assert (whole[gate] - split[gate]).abs().max() > 1e-8


@pytest.mark.parametrize("experts,top_k,tied", [(4, 1, False), (8, 2, True), (4, 2, False)])
def test_hf_mixtral_logits_and_bitwise_roundtrip(tmp_path, experts, top_k, tied, report):
    """zerotron -> HF: transformers' MixtralForCausalLM gives the same logits (fp32 rounding);
    HF save_pretrained -> zerotron -> export: the same tensors, bitwise."""
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    torch.manual_seed(experts + top_k)
    cfg = MixtralConfig(**SMALL, n_experts=experts, experts_top_k=top_k, tie_word_embeddings=tied)
    ours = Mixtral(cfg).eval()
    export_hf_mixtral(ours, None, tmp_path / "z")
    assert json.loads((tmp_path / "z" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "z").eval()
    x = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    report(f"hf mixtral logits (E={experts}, k={top_k}, tied={tied}): max abs diff {diff:.3g} (fp32)")
    assert diff < 1e-5
    hf.save_pretrained(tmp_path / "hf")
    back = registry.load_hf(tmp_path / "hf")
    registry.export_hf(back, tmp_path / "again")
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hf_unsupported_router_refused_in_one_line(tmp_path, data_cache, capsys):
    cfg = MixtralConfig(**{**SMALL, "vocab_size": 512}, n_experts=4, experts_top_k=2)
    src = export_hf_mixtral(Mixtral(cfg), None, tmp_path / "hf")
    c = json.loads((src / "config.json").read_text())
    with pytest.raises(ValueError, match="router_jitter_noise"):
        hf_config_to_mixtral({**c, "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="num_experts_per_tok=5 > num_local_experts=4"):
        hf_config_to_mixtral({**c, "num_experts_per_tok": 5})
    (src / "config.json").write_text(json.dumps({**c, "router_jitter_noise": 0.1}))
    run = tmp_path / "run"
    code = main(["train", "--config", "configs/moe_tiny.toml", "--run-dir", str(run), "--model.init_from", str(src),
                 "--data.cache_dir", data_cache, "--train.steps", "1", "--log.progress", "false"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "router_jitter_noise" in lines[0], lines
    assert not run.exists()


@pytest.mark.parametrize("overrides,world,message", [
    ({"parallel.ep": 3}, 6, "parallel.ep (3) must divide model.n_experts (8)"),
    ({"parallel.ep": 4}, 2, "parallel.ep (4) must divide the batch degree dp x cp (2 x 1)"),
    ({"model.experts_top_k": 9}, 1, "model.experts_top_k (9) exceeds model.n_experts (8)"),
    ({"model.arch": "llama", "parallel.ep": 2}, 2, "this model has none"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True, "model.moe_capacity_factor": 1.25}, 2,
     "model.moe_capacity_factor with parallel.sequence_parallel"),
    ({"parallel.cp": 2, "model.moe_capacity_factor": 1.0}, 2, "model.moe_capacity_factor with parallel.sequence_parallel or parallel.cp"),
    ({"parallel.cp": 2, "parallel.ep": 4}, 2, "parallel.ep (4) must divide the batch degree dp x cp (1 x 2)"),  # ep x cp composes
    ({"parallel.ep": 2, "parallel.pp": 2, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}, 4,
     "parallel.ep > 1 under a pipeline composes with native DDP and native ZeRO-1/2/3 without HSDP"),
    ({"parallel.ep": 2, "parallel.pp": 2, "parallel.dp_impl": "torch"}, 4, "parallel.ep > 1 under a pipeline composes"),
    ({"parallel.ep": 2, "parallel.dp_replicate": 2, "parallel.zero_stage": 2, "parallel.zero_impl": "fsdp2"}, 4,
     "parallel.ep > 1 with FSDP2's HSDP"),
    ({"parallel.ep": 4, "parallel.dp_replicate": 2, "parallel.zero_stage": 2}, 4,
     "parallel.ep (4) must divide the shard degree dp / dp_replicate x cp (2 x 1)"),
    ({"parallel.ep": 2, "parallel.pp": 2, "parallel.pp_impl": "torch", "parallel.pp_schedule": "gpipe"}, 4,
     "parallel.ep > 1 runs on the plain runner and the native pipeline executor"),
    ({"model.arch": "llama", "model.n_experts": 4}, 1, "applies to model.arch = 'mixtral' only"),
])
def test_plan_refusals_one_line(overrides, world, message):
    base = {k: v for k, v in {"model.arch": "mixtral", "model.n_experts": 8, "model.experts_top_k": 2,
                               "model.n_kv_head": 2}.items() if k not in overrides or k == "model.arch"}
    if overrides.get("model.arch") == "llama":
        base = {"model.arch": "llama"}
    with pytest.raises(ConfigError) as e:
        build_plan(tiny_config({**base, **overrides}), world)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_moe_tiny_config_and_presets():
    """configs/moe_tiny.toml resolves to 8 experts top-2 (even n_layer); the presets count total vs
    active parameters (Mixtral-8x7B: 46.7B total, 12.9B active, as published)."""
    from zerotron.config import load_config

    cfg = load_config("configs/moe_tiny.toml")
    m = registry.config_from_section(cfg.model, 512)
    assert isinstance(m, MixtralConfig) and (m.n_experts, m.experts_top_k, m.n_layer % 2) == (8, 2, 0)
    assert build_plan(load_config("configs/moe_tiny.toml", [("parallel.ep", "4")]), 4).ep == 4
    with torch.device("meta"):
        big = Mixtral(registry.preset_config("mixtral-8x7b"))
    assert big.num_params() == 46_702_792_704 and big.num_active_params() == 12_879_925_248
    assert registry.arch_of(big) == "mixtral" and registry.arch_of(registry.preset_config("llama-tiny")) == "llama"


def test_estimators_count_total_and_active_parameters():
    """analysis.flops.Shape of a Mixtral config: num_params = the model's count, active_params =
    Mixtral.num_active_params, and the 6N FLOP rule takes the active ones (for mixtral-8x7b too)."""
    from zerotron.analysis.flops import shape_of

    for cfg in (MixtralConfig(**SMALL, n_experts=4, experts_top_k=2, moe_shared_intermediate_size=8),
                registry.preset_config("mixtral-8x7b")):
        with torch.device("meta"):
            m = Mixtral(cfg)
        s = shape_of(cfg)
        assert (s.num_params(), s.active_params()) == (m.num_params(), m.num_active_params())
        assert s.flop_params() == m.num_active_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.n_embd)
