"""GPT-2-style decoder-only transformer, written to be read (after nanoGPT).

Architecture (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", and the
reference TF code / HF ``GPT2LMHeadModel``): learned token + position embeddings, ``n_layer``
pre-LayerNorm residual blocks (causal multi-head self-attention, then a 4x GELU MLP), a final
LayerNorm and an output projection tied to the token embedding.

Shapes used throughout: B batch, T sequence length, C = n_embd, V = vocab_size,
H = n_head, D = C // H (head_dim).

This file holds no parallelism code: strategies in ``zerotron.parallel`` transform a plain ``GPT``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class KVCache:
    """Per-layer key/value tensors for incremental decoding.

    ``keys[i]`` and ``values[i]`` have shape (B, H, T_cached, D). Attention layer ``i`` calls
    ``update(i, k, v)`` with the new (B, H, T_new, D) keys/values and attends to what it returns.
    """

    def __init__(self, n_layer: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def __len__(self) -> int:
        """Number of cached positions (of layer 0; all layers agree between forward calls)."""
        return 0 if self.keys[0] is None else self.keys[0].size(2)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (B, H, T_new, D) for ``layer``; return all cached (B, H, T_total, D)."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def reset(self) -> None:
        """Drop every cached tensor."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) -> (B, T, C).

    ``c_attn`` output rows are ordered [q | k | v]; each C-wide part is split into heads via
    view(B, T, H, D). Scores are scaled by 1/sqrt(D) (Vaswani et al. 2017) inside
    ``F.scaled_dot_product_attention``.
    """

    def __init__(self, cfg: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.n_head, self.n_embd, self.layer_idx = cfg.n_head, cfg.n_embd, layer_idx
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H, S, D), S = cached + T
        S = k.size(2)
        mask, causal = None, False
        if S == T:
            causal = True  # no earlier context: plain causal attention
        elif T > 1:
            # new query i sits at absolute position S - T + i and sees keys 0 .. S - T + i
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        # else T == 1 with a cache: the single new token may attend to every cached position
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


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


class GPT(nn.Module):
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

    def embed(self, idx: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Token + position embeddings (then dropout): idx (B, T) int64 -> (B, T, C).

        Positions are start_pos .. start_pos+T-1. Raises ValueError if idx is not 2-D or
        start_pos + T > block_size.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        T = idx.size(1)
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence too long: start_pos {start_pos} + length {T} = "
                             f"{start_pos + T} > block_size {self.config.block_size}")
        pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and tied output projection: (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V), float; no loss here (the trainer computes it).

        With ``kv_cache`` the tokens continue the cached sequence (positions len(cache) onward)
        and the cache grows by T. Raises ValueError if len(cache) + T > block_size.
        """
        x = self.embed(idx, start_pos=len(kv_cache) if kv_cache is not None else 0)
        for block in self.transformer.h:
            x = block(x, kv_cache)
        return self.head(x)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Autoregressive sampling: idx (B, T0) -> (B, T0 + max_new_tokens) int64.

        One prefill forward, then one token per step through a KVCache. ``temperature == 0`` is
        greedy argmax (deterministic); otherwise logits / temperature, optionally restricted to
        the ``top_k`` largest, are sampled with ``torch.multinomial(generator=generator)``.
        Context cropping: the model only sees the last block_size tokens. When the cache is full,
        it is rebuilt from the last block_size tokens (positions restart at 0), exactly what a
        no-cache loop over ``idx[:, -block_size:]`` computes; past that point each step is a
        full forward. Dropout is active if the model is in training mode: call ``eval()`` first.
        Raises ValueError for an empty prompt, negative max_new_tokens/temperature or top_k < 1.
        """
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"idx must have shape (B, T0) with T0 >= 1, got {tuple(idx.shape)}")
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, top_k >= 1; got "
                             f"{max_new_tokens}, {temperature}, {top_k}")
        block_size = self.config.block_size
        cache = KVCache(self.config.n_layer)
        next_input = idx[:, -block_size:]
        for _ in range(max_new_tokens):
            if len(cache) + next_input.size(1) > block_size:  # window full: re-prefill, cropped
                cache.reset()
                next_input = idx[:, -block_size:]
            logits = self(next_input, kv_cache=cache)[:, -1, :].float()  # (B, V)
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
            next_input = next_token
        return idx
