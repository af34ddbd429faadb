"""zerotron.models.llama: shapes, layout, RoPE, GQA under an emulated head split, sequence-parallel
shapes, KV cache, buffers after to_empty, presets; the [model] config section for llama."""
import math

import pytest
import torch
import torch.nn as nn

from zerotron.config import ConfigError, load_config, model_shape
from zerotron.models import registry
from zerotron.models.layout import get_module
from zerotron.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    RotaryEmbedding,
    parse_rope_scaling,
    preset_config,
    rope_inv_freq,
)
from zerotron.plan import build_plan

CFG = LlamaConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  intermediate_size=48)
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8}


def make_model(cfg=CFG, seed=0, scale=0.1):
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():  # larger weights than the 0.02 init, non-trivial norms
        for name, p in model.named_parameters():
            p.copy_(1 + scale * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return model.eval()


def ids(n=12, vocab=CFG.vocab_size):
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(5))


def test_shapes_pieces_and_no_bias():
    model = make_model()
    logits = model(ids())
    assert logits.shape == (2, 12, CFG.vocab_size)
    x = model.embed(ids())
    for block in model.blocks():
        x = block(x, None)
    assert torch.equal(model.head(x), logits)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 8, 32) and attn.q_proj.weight.shape == (32, 32)
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="block_size"):
        model(ids(33))


def test_layout_covers_every_parameter_and_tp_rules():
    model = make_model()
    lay = model.layout()
    block = model.blocks()[0]
    for path, spec in lay.block_tp.items():
        assert isinstance(get_module(block, path), nn.Linear), path
    assert {p for p, s in lay.block_tp.items() if s.style == "row"} == {"self_attn.o_proj", "mlp.down_proj"}
    assert lay.block_tp["self_attn.k_proj"].granule == 8 and lay.tied == ()
    owned = {id(p) for path in (*lay.embedding, *lay.head, lay.blocks)
             for p in get_module(model, path).parameters()}
    assert owned == {id(p) for p in model.parameters()}
    assert callable(get_module(model.blocks()[1], lay.attention).dropout_rng)
    lay.check_tp(2)
    odd = Llama(LlamaConfig(**{**CFG.__dict__, "intermediate_size": 51})).layout()
    for lay_, tp, name in ((lay, 4, r"model.n_kv_head \(2\)"), (lay, 3, r"model.n_head \(4\)"),
                           (odd, 2, r"model.intermediate_size \(51\)")):
        with pytest.raises(ValueError, match=name):
            lay_.check_tp(tp)
    tied = Llama(LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True}))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.layout().tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert tied.num_params() == tied.num_params(non_embedding=True)
    assert model.num_params() - model.num_params(non_embedding=True) == 97 * 32


def test_rope_tables_relative_positions_and_scaling():
    rot = RotaryEmbedding(8, 32, 10000.0)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).double() / 8)
    assert torch.allclose(rot.cos[5, :4].double(), torch.cos(5 * inv), atol=1e-6)
    assert torch.equal(rot.cos[:, :4], rot.cos[:, 4:])  # halves convention: [f, f]
    # rotation preserves norms; <R(m)q, R(n)k> depends on m - n only (Su et al. 2021, sec. 3.4.2)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    dot = lambda m, n: (rot(q, m) * rot(k, n)).sum().item()  # noqa: E731
    assert math.isclose(dot(7, 3), dot(24, 20), rel_tol=1e-5) and not math.isclose(dot(7, 3), dot(7, 4), rel_tol=1e-3)
    assert torch.allclose(rot(q, 11).norm(), q.norm())
    # llama3 scaling: high frequencies kept, low ones divided by factor, the middle interpolated
    plain, scaled = rope_inv_freq(64, 500000.0), rope_inv_freq(64, 500000.0, {**L3, "original_max_position_embeddings": 8192})
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


def test_rope_buffers_shared_non_persistent_rebuilt_after_to_empty():
    with torch.device("meta"):
        meta = Llama(CFG)
    rots = {id(b.self_attn.rotary) for b in meta.blocks()}
    assert len(rots) == 1 and not any("rotary" in k for k in meta.state_dict())
    ref = make_model()
    meta.to_empty(device="cpu")
    meta.init_buffers()
    assert torch.equal(meta.blocks()[1].self_attn.rotary.cos, ref.blocks()[0].self_attn.rotary.cos)
    meta.load_state_dict(ref.state_dict())
    assert torch.equal(meta.eval()(ids()), ref(ids()))
    # fp64 mode: the tables follow the model dtype and keep their values through init_buffers
    d = make_model().to(torch.float64)
    d.init_buffers()
    rot = d.blocks()[0].self_attn.rotary
    assert rot.sin.dtype == torch.float64 and torch.equal(rot.sin, ref.blocks()[0].self_attn.rotary.sin.double())


def _slice_heads(block, r, tp):
    """Rank r's shard of a dense block's attention, Megatron split (column q/k/v, row o)."""
    import copy

    a = copy.deepcopy(block.self_attn)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(a, name).weight
        n = w.size(0) // tp
        setattr(a, name, nn.Linear(w.size(1), n, bias=False))
        getattr(a, name).weight.data.copy_(w[r * n:(r + 1) * n])
    w = a.o_proj.weight
    n = w.size(1) // tp
    a.o_proj = nn.Linear(n, w.size(0), bias=False)
    a.o_proj.weight.data.copy_(w[:, r * n:(r + 1) * n])
    return a


def test_gqa_head_split_over_tp_equals_dense():
    """Each tp rank holding H/tp query and H_kv/tp kv heads (shapes alone tell it) sums to dense:
    the local query heads pick the right local kv head."""
    model = make_model()
    block = model.blocks()[0]
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    dense = block.self_attn(x)
    for tp in (1, 2):
        total = sum(_slice_heads(block, r, tp)(x) for r in range(tp))
        assert torch.allclose(total, dense, atol=1e-6), tp


class _Gather(nn.Module):
    """A column-parallel projection under sequence parallelism: its input is this rank's T/2
    positions, its output covers the whole sequence."""

    def __init__(self, lin, full):
        super().__init__()
        self.lin, self.full = lin, full

    def forward(self, x):
        assert x.size(1) == self.full.size(1) // 2
        return self.lin(self.full)


def test_sequence_parallel_shapes_take_T_from_the_projection():
    model = make_model()
    attn = model.blocks()[0].self_attn
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    dense = attn(x)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, _Gather(getattr(attn, name), x))
    out = attn(x[:, :6])  # full-T attention output, as o_proj's reduce-scatter input
    assert torch.allclose(out, dense, atol=1e-6)


def test_kv_cache_generation_equals_full_forward():
    model = make_model()
    prompt = ids(5)
    out = model.generate(prompt, 40, temperature=0)  # crosses block_size 32: cache rebuilt
    ref = prompt
    for _ in range(40):
        ref = torch.cat([ref, model(ref[:, -32:])[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_init_and_presets():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_embd=256, n_head=4, n_kv_head=1, intermediate_size=512))
    w = model.model.layers[0].mlp.down_proj.weight
    assert abs(w.std().item() - 0.02) < 1e-3 and torch.equal(model.model.norm.weight, torch.ones(256))
    expected = {"llama3-8b": 8_030_261_248, "llama2-7b": 6_738_415_616, "llama3.2-1b": 1_235_814_400,
                "llama3-70b": 70_553_706_496}
    for name, n in expected.items():
        with torch.device("meta"):
            m = Llama(preset_config(name))
        assert m.num_params() == n, name
    assert preset_config("llama3.2-1b").tie_word_embeddings and preset_config("llama3.2-1b").rope_scaling["factor"] == 32
    assert set(PRESETS) == {"llama-tiny", "llama3.2-1b", "llama2-7b", "llama3-8b", "llama3-70b"}
    assert not set(PRESETS) & set(registry.ARCHS["gpt2"].presets)  # a preset names its family


@pytest.mark.parametrize("bad, msg", [
    (dict(n_kv_head=3), "multiple of n_kv_head"), (dict(n_head=8, n_embd=24), "even"),
    (dict(bias=True), "no biases"), (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "'yarn' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks"), (dict(intermediate_size=0), "intermediate_size"),
    (dict(rope_scaling={**L3, "low_freq_factor": 5.0}), "low_freq_factor < high"),
])
def test_config_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        LlamaConfig(**{**CFG.__dict__, **bad}).validate()


def test_parse_rope_scaling():
    assert parse_rope_scaling("none") is None
    assert parse_rope_scaling("llama3")["factor"] == 8.0
    got = parse_rope_scaling("llama3:factor=32, original_max_position_embeddings=4096")
    assert got["factor"] == 32.0 and got["original_max_position_embeddings"] == 4096 and got["high_freq_factor"] == 4.0
    for bad in ("yarn", "llama3:factor", "llama3:size=2", "llama3:factor=x"):
        with pytest.raises(ValueError, match="rope_scaling"):
            parse_rope_scaling(bad)


def cfg_of(**overrides):
    return load_config("configs/llama_tiny.toml", [(k, str(v)) for k, v in overrides.items()])


def test_model_section_resolution_and_refusals():
    shape = model_shape(cfg_of().model)
    assert shape["arch"] == "llama" and shape["n_kv_head"] == 2 and shape["intermediate_size"] == 192
    assert shape["bias"] is False and shape["tie_word_embeddings"] is False and shape["rope_scaling"] is None
    # the preset alone picks the family; fields override it; tie left unset takes the preset's
    c = load_config(None, [("model.preset", "llama3.2-1b"), ("model.n_layer", "2")])
    s = model_shape(c.model)
    assert (s["arch"], s["n_layer"], s["tie_word_embeddings"], s["rope_scaling"]["factor"]) == ("llama", 2, True, 32.0)
    s = model_shape(load_config(None, [("model.preset", "llama3.2-1b"), ("model.tie_word_embeddings", "false"),
                                       ("model.rope_scaling", "none")]).model)
    assert s["tie_word_embeddings"] is False and s["rope_scaling"] is None
    s = model_shape(load_config(None, [("model.arch", "llama"), ("model.n_embd", "4096")]).model)
    assert s["n_kv_head"] == 4 and s["intermediate_size"] == 11008 and s["rope_theta"] == 10000.0
    assert registry.config_from_section(cfg_of().model, 512) == preset_config("llama-tiny", vocab_size=512)
    refusals = [
        (dict(**{"model.bias": "true"}), "model.bias = true is not available for model.arch = 'llama'"),
        (dict(**{"model.arch": "gpt2"}), "llama preset but model.arch = 'gpt2'"),
        (dict(**{"model.n_kv_head": 3}), "multiple of model.n_kv_head"),
        (dict(**{"parallel.tp": 4, "model.n_head": 8, "model.n_embd": 64}), "divide model.n_kv_head"),
        (dict(**{"model.rope_scaling": "yarn"}), "model.rope_scaling 'yarn' is not supported"),
        (dict(**{"parallel.tp": 2, "model.intermediate_size": 191}), "divide model.intermediate_size"),
        (dict(**{"model.arch": "bert", "model.preset": ""}), "unknown model architecture 'bert'"),
    ]
    for overrides, msg in refusals:
        with pytest.raises(ConfigError, match=msg):
            build_plan(cfg_of(**overrides), 4)
    for overrides, msg in (({"model.n_kv_head": "2"}, "applies to model.arch = 'llama' only"),
                           ({"model.tie_word_embeddings": "false"}, "not available for gpt2")):
        with pytest.raises(ConfigError, match=msg):
            build_plan(load_config("configs/tiny.toml", list(overrides.items())), 1)
    build_plan(cfg_of(**{"parallel.tp": 2}), 2)
    build_plan(cfg_of(**{"model.bias": "false"}), 1)


def test_registry_meta_round_trip_and_old_checkpoints():
    from zerotron.models.gpt import GPT, GPTConfig

    cfg = preset_config("llama3.2-1b", n_layer=1, block_size=16, vocab_size=64)
    meta = registry.config_meta(cfg)
    assert meta["arch"] == "llama" and registry.config_from_meta(meta) == cfg
    old = {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16, "dropout": 0.0,
           "bias": True, "layer_norm_eps": 1e-5}  # written before model_config had "arch"
    assert registry.config_from_meta(old) == GPTConfig(**old)
    assert isinstance(registry.build_model(registry.config_from_meta(old)), GPT)
    assert registry.arch_of(Llama(CFG)) == "llama" and registry.preset_arch("tiny") == "gpt2"
    with pytest.raises(ValueError, match="unknown model architecture 'bert'"):
        registry.config_from_meta({**old, "arch": "bert"})
    with pytest.raises(ValueError, match="valid presets: tiny.*llama-tiny"):
        registry.preset_config("nope")
