"""GPT-2-style decoder-only transformer, written to be read (after nanoGPT).

Architecture (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", and the
reference TF code / HF ``GPT2LMHeadModel``): learned token + position embeddings, ``n_layer``
pre-LayerNorm residual blocks (causal multi-head self-attention, then a 4x GELU MLP), a final
LayerNorm and an output projection tied to the token embedding.

Shapes used throughout: B batch, T sequence length, C = n_embd, V = vocab_size,
H = n_head, D = C // H (head_dim).

This file holds no parallelism code: strategies in ``zerotron.parallel`` transform a plain ``GPT``
through the description :meth:`GPT.layout` returns (``zerotron.models.layout``). ``forward`` and
``generate`` are the shared ones of ``zerotron.models.base.CausalLM``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .base import DENSE, CausalLM, KVCache
from .layout import ModelLayout, TPLinear


@dataclass
class GPTConfig:
    """Model hyper-parameters. Sizes are counts (tokens, layers, heads, channels)."""

    vocab_size: int = 8192
    block_size: int = 256  # maximum number of positions (learned position embeddings)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # embedding, attention and residual dropout probability
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2: True)
    layer_norm_eps: float = 1e-5

    def validate(self) -> "GPTConfig":
        """Check the sizes; return self. Raises ValueError naming the bad field."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"GPTConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        return self


_GPT2 = dict(vocab_size=50257, block_size=1024)
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, **_GPT2),  # 124,439,808 parameters
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **_GPT2),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, **_GPT2),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, **_GPT2),
    # GPT-2 architecture at LLaMA-7B width/depth (~6.6e9 params); for memory/FLOP estimates only.
    "7b": dict(n_layer=32, n_head=32, n_embd=4096, vocab_size=50257, block_size=2048),
}


def preset_config(name: str, **overrides) -> GPTConfig:
    """Return the validated GPTConfig of preset ``name`` with ``overrides`` applied.

    Raises ValueError for an unknown preset (listing the valid ones) or an invalid result,
    TypeError for an override that is not a GPTConfig field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides}).validate()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) -> (B, T, C).

    ``c_attn`` output rows are ordered [q | k | v]; each third is split into heads via
    view(B, T, -1, D), so a column-parallel ``c_attn`` holding H/tp heads of each part works as is.
    Scores are scaled by 1/sqrt(D) (Vaswani et al. 2017) inside ``F.scaled_dot_product_attention``.
    """

    def __init__(self, cfg: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.head_dim, self.layer_idx = cfg.n_embd // cfg.n_head, layer_idx
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout_rng = contextlib.nullcontext  # attention-probability dropout stream (TP: tracked)
        self.parallel_hooks = DENSE  # its attention (context parallelism: over the cp group)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 * H_local * D); T is the full sequence even under SP
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H, S, D), S = cached + T
        p = self.dropout if self.training else 0.0
        with self.dropout_rng() if p > 0 else contextlib.nullcontext():
            y = self.parallel_hooks.attention(q, k, v, p, kv_cache.pad if kv_cache is not None else None)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward: (B, T, C) -> Linear(C, 4C) -> GELU(tanh) -> Linear(4C, C).

    GELU with the tanh approximation (Hendrycks & Gimpel 2016) equals HF's ``gelu_new``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). (B,T,C)->(B,T,C)."""

    def __init__(self, cfg: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    """GPT-2 language model: token ids (B, T) -> next-token logits (B, T, V).

    Module names match HF ``GPT2LMHeadModel`` (``transformer.wte``, ``transformer.h.0.attn.c_attn``,
    ...), so ``zerotron.models.hf`` converts weights by name (HF's Conv1D weights are transposed).
    ``lm_head.weight`` is the same Parameter as ``transformer.wte.weight`` (weight tying, Press &
    Wolf 2017). Raises ValueError if ``cfg`` is invalid.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg.validate()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init (Radford et al. 2019; nanoGPT): Linear/Embedding weights N(0, 0.02), biases 0,
        LayerNorm weight 1 / bias 0, and every residual projection ``c_proj.weight`` N(0,
        0.02/sqrt(2*n_layer)) because 2 of them add to the residual stream per layer. Modules are
        visited in a fixed order, so the result depends only on torch's RNG state."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = resid_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, the tied wte/lm_head weight counted once. With ``non_embedding`` the
        position embeddings are left out (nanoGPT convention; wte stays, it is the output layer)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates tied weights
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def embed(self, idx: torch.Tensor, start_pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings (then dropout): idx (B, T) int64 -> (B, T, C).

        Positions are start_pos .. start_pos+T-1, or per row ``positions`` (B, T) int64 (a
        left-padded batch, see ``KVCache.pad``), or those of ``parallel_hooks.positions`` (context
        parallelism: this rank's global positions); under sequence parallelism (``parallel_hooks.
        seq_shard()`` = (i, n)) the token embedding returns this rank's (B, T/n, C) and the positions
        are those of shard i. Raises ValueError if idx is not 2-D or start_pos + T > block_size.
        """
        self.check_positions(idx, start_pos)
        if positions is None and start_pos == 0:
            positions = self.parallel_hooks.positions(idx.size(1), idx.device)  # None: 0 .. T-1
        index, count = self.parallel_hooks.seq_shard()
        T = idx.size(1) // count
        start_pos += index * T
        if positions is not None:
            pos = positions[:, index * T:(index + 1) * T]
        else:
            pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def layout(self) -> ModelLayout:
        """GPT-2's layout for the parallel engine: wte/wpe/drop before the blocks, ln_f and the tied
        lm_head after; attention and MLP Megatron-split (fused [q|k|v] as 3 chunks of whole heads)."""
        if getattr(self, "_layout", None) is None:
            cfg, D = self.config, self.config.n_embd // self.config.n_head
            self._layout = ModelLayout(
                blocks="transformer.h",
                embedding=("transformer.wte", "transformer.wpe", "transformer.drop"),
                head=("transformer.ln_f", "lm_head"),
                token_embedding="transformer.wte", output="lm_head",
                tied=(("lm_head.weight", "transformer.wte.weight"),),
                block_tp={"attn.c_attn": TPLinear("column", chunks=3, granule=D),
                          "attn.c_proj": TPLinear("row"),
                          "mlp.c_fc": TPLinear("column"), "mlp.c_proj": TPLinear("row")},
                attention="attn", width=cfg.n_embd, vocab_size=cfg.vocab_size,
                tp_divides={"n_head": cfg.n_head})
        return self._layout

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and tied output projection: (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.transformer.ln_f(x))
