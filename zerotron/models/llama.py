"""Llama-family decoder-only transformer (Llama 2, Llama 3, Llama 3.2), written to be read.

Architecture (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models" and
"Llama 2"; Meta's reference code / HF ``LlamaForCausalLM``): a token embedding without positions,
``n_layer`` pre-norm residual blocks -- RMSNorm (Zhang & Sennrich 2019), causal self-attention with
rotary position embeddings (RoPE, Su et al. 2021 "RoFormer") and grouped-query attention (GQA,
Ainslie et al. 2023: ``n_kv_head`` key/value heads, each shared by n_head/n_kv_head query heads),
RMSNorm, a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer": down(silu(gate(x)) *
up(x))) -- a final RMSNorm and an output projection (untied by default; tied in small variants such
as Llama-3.2-1B). No biases anywhere. RoPE may use the Llama-3.1 frequency scaling (rope_scaling
rope_type "llama3").

Shapes used throughout: B batch, T sequence length, C = n_embd, V = vocab_size, H = n_head,
H_kv = n_kv_head, D = C // H (head_dim), F = intermediate_size.

This file holds no parallelism code: strategies in ``zerotron.parallel`` transform a plain ``Llama``
through the description :meth:`Llama.layout` returns (``zerotron.models.layout``). ``forward`` and
``generate`` are the shared ones of ``zerotron.models.base.CausalLM``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import DENSE, CausalLM, KVCache
from .layout import ModelLayout, TPLinear

__all__ = ["LlamaConfig", "Llama", "PRESETS", "preset_config", "default_intermediate_size",
           "rope_inv_freq", "RotaryEmbedding"]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def default_intermediate_size(n_embd: int, multiple_of: int = 256) -> int:
    """Meta's SwiGLU width rule (Llama reference ``FeedForward``): int(2/3 * 4C) rounded up to a
    multiple of ``multiple_of`` (Llama-2-7B: C = 4096 -> 11008), so that the three SwiGLU matrices
    cost about what GELU's two 4C ones do (Shazeer 2020)."""
    hidden = int(2 * 4 * n_embd / 3)
    return multiple_of * -(-hidden // multiple_of)


@dataclass
class LlamaConfig:
    """Model hyper-parameters. Sizes are counts (tokens, layers, heads, channels).

    ``rope_scaling``: None, or the Llama-3.1 dict ``{"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` (HF config.json
    form); other scaling types are refused by :meth:`validate`."""

    vocab_size: int = 8192
    block_size: int = 256  # maximum number of positions (RoPE tables are this long)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4  # key/value heads (GQA); n_head = multi-head attention, 1 = multi-query
    n_embd: int = 128
    intermediate_size: int = 512  # SwiGLU hidden width F
    rope_theta: float = 10000.0  # RoPE base (Llama 2: 1e4, Llama 3: 5e5)
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    dropout: float = 0.0  # attention-probability and residual dropout (not in Meta's models)
    bias: bool = False  # always False: Llama has no biases (kept for a uniform config interface)

    @property
    def head_dim(self) -> int:
        """D = n_embd // n_head."""
        return self.n_embd // self.n_head

    def validate(self) -> "LlamaConfig":
        """Check the sizes; return self. Raises ValueError naming the bad field."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                     "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"LlamaConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head "
                             f"({self.n_kv_head}): each kv head serves n_head/n_kv_head query heads")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim n_embd/n_head = {self.head_dim} must be even (RoPE "
                             "rotates pairs of channels)")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rope_theta and rms_norm_eps must be > 0, got {self.rope_theta}, "
                             f"{self.rms_norm_eps}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.bias:
            raise ValueError("LlamaConfig.bias must be False: Llama has no biases (model.bias is for gpt2)")
        check_rope_scaling(self.rope_scaling)
        return self


def check_rope_scaling(scaling) -> None:
    """Raise ValueError unless ``scaling`` is None or a valid Llama-3 (``rope_type`` "llama3")
    dict with positive ``factor``, ``original_max_position_embeddings`` and ``0 < low_freq_factor
    < high_freq_factor``. Other types (linear, dynamic, yarn, longrope, ...) are refused by name."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be None or a dict, got {scaling!r}")
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported: zerotron implements plain RoPE and "
                         "the Llama-3 scaling (rope_type 'llama3') only")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling llama3 lacks {', '.join(missing)}")
    f, lo, hi, n = (scaling[k] for k in _LLAMA3_KEYS)
    if not (f > 0 and n > 0 and 0 < lo < hi):
        raise ValueError(f"rope_scaling llama3 needs factor > 0, original_max_position_embeddings > 0 and "
                         f"0 < low_freq_factor < high_freq_factor, got {scaling}")


LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # Llama-3.1's published values


def parse_rope_scaling(text: str) -> dict | None:
    """The ``model.rope_scaling`` string -> rope_scaling: "none" -> None; "llama3" -> the Llama-3.1
    values (factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings
    8192); "llama3:factor=32,original_max_position_embeddings=8192" overrides some of them.
    Raises ValueError naming the supported forms for anything else."""
    kind, _, rest = text.strip().partition(":")
    if kind == "none" and not rest:
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling {text!r} is not supported: use none, llama3 or "
                         "llama3:factor=F,low_freq_factor=L,high_freq_factor=H,original_max_position_embeddings=N")
    out = dict(LLAMA31_SCALING)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in _LLAMA3_KEYS or not eq:
            raise ValueError(f"rope_scaling {text!r}: {item!r} is not key=value with a key among "
                             f"{', '.join(_LLAMA3_KEYS)}")
        try:
            out[key] = int(value) if key == "original_max_position_embeddings" else float(value)
        except ValueError:
            raise ValueError(f"rope_scaling {text!r}: {key} must be a number, got {value!r}") from None
    check_rope_scaling(out)
    return out


_L3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
PRESETS: dict[str, dict] = {
    # a test size: GQA with 2 query heads per kv head, 4 layers and 4 heads (every tp/pp of 1, 2)
    "llama-tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=192,
                       block_size=64),
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (tied head)
    "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                        block_size=131072, tie_word_embeddings=True, **_L3,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters
    "llama2-7b": dict(n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, intermediate_size=11008,
                      block_size=4096, vocab_size=32000, rope_theta=10000.0, rms_norm_eps=1e-5),
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters
    "llama3-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                      block_size=8192, **_L3),
    # meta-llama/Meta-Llama-3-70B: 70,553,706,496 parameters
    "llama3-70b": dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                       block_size=8192, **_L3),
}


def preset_config(name: str, **overrides) -> LlamaConfig:
    """Return the validated LlamaConfig of preset ``name`` with ``overrides`` applied.

    Raises ValueError for an unknown preset (listing the valid ones) or an invalid result,
    TypeError for an override that is not a LlamaConfig field."""
    if name not in PRESETS:
        raise ValueError(f"unknown llama preset {name!r}; valid presets: {', '.join(PRESETS)}")
    base = dict(PRESETS[name])
    if base.get("rope_scaling"):
        base["rope_scaling"] = dict(base["rope_scaling"])  # callers may edit their copy
    return LlamaConfig(**{**base, **overrides}).validate()


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim/2,) float32: theta^(-2i/D), i = 0 .. D/2-1 (Su et al.
    2021, eq. 15), computed exactly as HF transformers does. With Llama-3 ``scaling`` (Meta's
    ``apply_scaling``, Llama 3.1): wavelengths 2*pi/f longer than original/low_freq_factor are
    divided by ``factor``, shorter than original/high_freq_factor kept, and those in between
    interpolated smoothly. On CPU whatever the default device (meta included)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exps)
    if scaling is None:
        return inv_freq
    factor, lo, hi, old = (scaling[k] for k in _LLAMA3_KEYS)
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): [x1, x2] -> [-x2, x1] (the halves convention of HF / GPT-NeoX; Meta's
    interleaved pairs differ by a fixed permutation of the q/k projection rows)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables shared by every attention layer.

    Buffers ``cos`` and ``sin`` (block_size, D), non-persistent (not in state dicts): row p is
    cos/sin(p * [f, f]) for the inverse frequencies f of :func:`rope_inv_freq`. ``forward(x,
    start)`` rotates x (B, H, T, D) as positions start .. start+T-1. :meth:`reset` recomputes the
    tables (in float32 on CPU, then copied into the buffers' device and dtype), e.g. after
    ``to_empty``."""

    def __init__(self, head_dim: int, block_size: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("cos", torch.empty(block_size, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(block_size, head_dim), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """Fill ``cos``/``sin`` from theta, scaling and the positions 0 .. block_size-1."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        pos = torch.arange(self.cos.size(0), dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq[None, :]  # (block_size, D/2), as HF's position x inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """x (B, H, T, D) -> x * cos + rotate_half(x) * sin at positions start .. start+T-1, or at
        per-row positions ``start`` (B, T) int64 (a left-padded batch)."""
        T = x.size(2)
        if isinstance(start, torch.Tensor):
            cos = self.cos[start].to(x.dtype)[:, None]  # (B, 1, T, D)
            sin = self.sin[start].to(x.dtype)[:, None]
        else:
            cos = self.cos[start:start + T].to(x.dtype)
            sin = self.sin[start:start + T].to(x.dtype)
        return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads: (B, T, C) -> (B, T, C).

    ``q_proj`` (C -> H*D), ``k_proj``/``v_proj`` (C -> H_kv*D), ``o_proj`` (H*D -> C), no bias.
    Local head counts come from tensor shapes (view(B, T, -1, D)), so column-parallel q/k/v
    holding H/tp and H_kv/tp heads work unchanged; T is taken from the projection output (under
    sequence parallelism the block input holds T/tp positions, the projections the full T). RoPE
    positions start at ``kv_cache.cached(layer_idx)``. ``rotary`` is the model's shared
    :class:`RotaryEmbedding` (registered here too, so a block carries its tables)."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__()
        C, D = cfg.n_embd, cfg.head_dim
        self.head_dim, self.layer_idx, self.dropout = D, layer_idx, cfg.dropout
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=False)
        self.k_proj = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.v_proj = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=False)
        self.rotary = rotary
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout_rng = contextlib.nullcontext  # attention-probability dropout stream (TP: tracked)
        self.parallel_hooks = DENSE  # its positions and attention (context parallelism: global, over cp)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        q = self.q_proj(x)  # (B, T, H_local * D); T is the full sequence even under SP
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        start, pad = 0, None
        if kv_cache is not None:
            start, pad = kv_cache.cached(self.layer_idx), kv_cache.pad
            if pad is not None:  # a left-padded batch: per-row positions
                start = kv_cache.positions(T, self.layer_idx)
        else:
            pos = self.parallel_hooks.positions(T, q.device)  # (1, T) global positions, or None: 0 .. T-1
            start = start if pos is None else pos
        q, k = self.rotary(q, start), self.rotary(k, start)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H_kv, S, D), S = cached + T
        p = self.dropout if self.training else 0.0
        with self.dropout_rng() if p > 0 else contextlib.nullcontext():
            y = self.parallel_hooks.attention(q, k, v, p, pad)  # kv heads repeated for their query groups
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, -1)))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): (B, T, C) -> down(silu(gate(x)) * up(x)) -> (B, T, C),
    gate/up C -> F, down F -> C, no bias."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm residual block: x + attn(norm(x)), then x + mlp(norm(x)). (B,T,C) -> (B,T,C).
    A descendant family swaps the feed-forward layer by overriding :meth:`build_mlp` (Mixtral: MoE)."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps)
        self.mlp = self.build_mlp(cfg, layer_idx)

    def build_mlp(self, cfg: LlamaConfig, layer_idx: int) -> nn.Module:
        """The block's feed-forward layer, (B,T,C) -> (B,T,C): a SwiGLU :class:`LlamaMLP`."""
        return LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """Llama language model: token ids (B, T) -> next-token logits (B, T, V).

    Module names match HF ``LlamaForCausalLM`` (``model.embed_tokens``,
    ``model.layers.0.self_attn.q_proj``, ``model.layers.0.mlp.gate_proj``, ``model.norm``,
    ``lm_head``), so ``zerotron.models.hf_llama`` converts weights by name. With
    ``tie_word_embeddings`` ``lm_head.weight`` is the same Parameter as ``model.embed_tokens.weight``.
    Raises ValueError if ``cfg`` is invalid."""

    block_class = LlamaBlock  # a descendant family (Mixtral) swaps the block: (cfg, rotary, layer index)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg.validate()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.block_size, cfg.rope_theta, cfg.rope_scaling)
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            layers=nn.ModuleList([self.block_class(cfg, rotary, i) for i in range(cfg.n_layer)]),
            norm=nn.RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF Llama init (``initializer_range`` 0.02): Linear and Embedding weights N(0, 0.02),
        RMSNorm weights 1; then the RoPE tables. Modules are visited in a fixed order, so the
        result depends only on torch's RNG state."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the RoPE tables of every rotary module this model (or stage) holds."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset()

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, a tied embedding/head counted once. With ``non_embedding`` an untied
        token embedding (a lookup, no matmul) is left out; a tied one stays (it is the output
        layer), as GPT's count keeps wte."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_word_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def embed(self, idx: torch.Tensor, start_pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embedding: idx (B, T) int64 -> (B, T, C) (this rank's (B, T/n, C) under sequence
        parallelism; positions, including per-row ``positions``, enter through RoPE inside attention). Raises ValueError if idx is
        not 2-D or start_pos + T > block_size."""
        self.check_positions(idx, start_pos)
        return self.model.embed_tokens(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and output projection: (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.model.norm(x))

    def layout(self) -> ModelLayout:
        """Llama's layout for the parallel engine: embed_tokens before the blocks, norm and lm_head
        after; q/k/v and gate/up column-parallel (whole heads: granule D), o/down row-parallel.
        tp must divide n_head, n_kv_head (kv heads are split, never replicated) and intermediate_size."""
        if getattr(self, "_layout", None) is None:
            cfg = self.config
            col = TPLinear("column", granule=cfg.head_dim)
            self._layout = ModelLayout(
                blocks="model.layers", embedding=("model.embed_tokens",), head=("model.norm", "lm_head"),
                token_embedding="model.embed_tokens", output="lm_head",
                tied=(("lm_head.weight", "model.embed_tokens.weight"),) if cfg.tie_word_embeddings else (),
                block_tp={"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                          "self_attn.o_proj": TPLinear("row"),
                          "mlp.gate_proj": TPLinear("column"), "mlp.up_proj": TPLinear("column"),
                          "mlp.down_proj": TPLinear("row")},
                attention="self_attn", width=cfg.n_embd, vocab_size=cfg.vocab_size,
                tp_divides={"n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head,
                            "intermediate_size": cfg.intermediate_size})
        return self._layout
