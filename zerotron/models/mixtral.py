"""Mixtral-style mixture-of-experts decoder (Mixtral 8x7B, Qwen-MoE / Qwen3-MoE shapes), written to be read.

Architecture (Jiang et al. 2024, "Mixtral of Experts"; HF ``MixtralForCausalLM``): the Llama block
of :mod:`zerotron.models.llama` (RMSNorm, RoPE + GQA attention) with its SwiGLU MLP replaced by a
sparse MoE layer (:class:`zerotron.models.moe.MoE`: a linear router, top-k selection, E SwiGLU
experts, optional shared expert, capacity mode and the auxiliary losses; its module docstring states
the rules). This module holds the family's config, presets, block and model, and the layout the
parallel engine reads (experts declared for expert parallelism).

Shapes: B batch, T positions, C = n_embd, E = n_experts, k = experts_top_k, F = intermediate_size
(per expert), N = B*T tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .layout import ExpertLayout, ModelLayout, TPLinear
from .llama import Llama, LlamaBlock, LlamaConfig
from .moe import ROUTERS, Experts, MoE

__all__ = ["MixtralConfig", "Mixtral", "PRESETS"]


@dataclass
class MixtralConfig(LlamaConfig):
    """Llama's fields (``intermediate_size`` is each expert's F) plus the MoE ones.

    ``n_experts`` E >= 1; ``experts_top_k`` 1 <= k <= E; ``moe_router`` one of :data:`ROUTERS`;
    ``moe_shared_intermediate_size`` width of the shared expert (0 = none);
    ``moe_aux_loss_coef`` / ``moe_z_loss_coef`` >= 0, weights of the auxiliary losses;
    ``moe_capacity_factor`` >= 0 (0 = dropless; else training forwards keep at most
    ceil(factor * N * k / E) assignments per expert, :meth:`MoE.capacity_keep`);
    ``moe_bias_update_rate`` >= 0 (0 = off; else the auxiliary-loss-free balancing bias,
    :func:`~zerotron.models.moe.update_expert_bias`)."""

    n_experts: int = 8
    experts_top_k: int = 2
    moe_router: str = "topk_softmax"
    moe_shared_intermediate_size: int = 0
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    moe_capacity_factor: float = 0.0
    moe_bias_update_rate: float = 0.0

    def validate(self) -> "MixtralConfig":
        """Llama's checks and the MoE ones; ValueError naming the field."""
        super().validate()
        for name in ("n_experts", "experts_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MixtralConfig.{name} must be a positive int, got {value!r}")
        if self.experts_top_k > self.n_experts:
            raise ValueError(f"model.experts_top_k ({self.experts_top_k}) exceeds model.n_experts "
                             f"({self.n_experts}): each token picks k distinct experts; lower experts_top_k")
        if self.moe_router not in ROUTERS:
            raise ValueError(f"model.moe_router {self.moe_router!r} is unknown; valid: {', '.join(ROUTERS)}")
        if self.moe_shared_intermediate_size < 0:
            raise ValueError("model.moe_shared_intermediate_size must be >= 0 (0 = no shared expert)")
        if self.moe_aux_loss_coef < 0 or self.moe_z_loss_coef < 0:
            raise ValueError("model.moe_aux_loss_coef and model.moe_z_loss_coef must be >= 0")
        for name in ("moe_capacity_factor", "moe_bias_update_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
                    and value < float("inf")):
                raise ValueError(f"model.{name} must be a finite number >= 0 (0 = off), got {value!r}")
        return self


PRESETS: dict[str, dict] = {
    # a test size: 8 experts top-2, every tp/pp of 1, 2 and ep of 1, 2, 4, 8
    "mixtral-tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
                         block_size=64, n_experts=8, experts_top_k=2),
    # mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters, 12,879,925,248 active per token (top-2 of 8)
    "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         block_size=32768, vocab_size=32000, rope_theta=1e6, rms_norm_eps=1e-5,
                         n_experts=8, experts_top_k=2),
    # Qwen/Qwen3-30B-A3B shapes (128 experts, top-8, no shared expert); Qwen3's q/k norms and
    # head_dim 128 != C/H are not modelled, so the count differs from the published 30.5B (3.3B active)
    "qwen3-moe-30b-a3b": dict(n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, intermediate_size=768,
                              block_size=40960, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                              n_experts=128, experts_top_k=8, moe_router="topk_softmax",
                              moe_aux_loss_coef=0.001),
}

class MixtralBlock(LlamaBlock):
    """Pre-RMSNorm residual block: x + attn(norm(x)), then x + moe(norm(x)). (B,T,C) -> (B,T,C)."""

    def build_mlp(self, cfg: MixtralConfig, layer_idx: int) -> nn.Module:
        """The sparse MoE layer in the MLP's place (same module name ``mlp``)."""
        return MoE(cfg, layer_idx)


class Mixtral(Llama):
    """Mixtral language model: token ids (B, T) -> next-token logits (B, T, V).

    Module names follow HF ``MixtralForCausalLM`` (transformers 5: ``model.layers.N.mlp.gate``,
    experts stacked; ``zerotron.models.hf_mixtral`` converts to and from the checkpoint format).
    Raises ValueError if ``cfg`` is invalid."""

    block_class = MixtralBlock  # Llama's __init__ builds the model with it

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF init (``initializer_range`` 0.02): Linear, Embedding and expert weights N(0, 0.02),
        RMSNorm weights 1, in module order; then the RoPE tables."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Experts):
                for p in (module.gate_proj, module.up_proj, module.down_proj):
                    nn.init.normal_(p, mean=0.0, std=0.02)
        self.init_buffers()

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the (E - k) experts it skips in each layer."""
        cfg = self.config
        per_expert = 3 * cfg.n_embd * cfg.intermediate_size
        return self.num_params() - cfg.n_layer * (cfg.n_experts - cfg.experts_top_k) * per_expert

    def layout(self) -> ModelLayout:
        """Llama's layout with the MLP replaced: attention column/row parallel under tp, the router
        and experts replicated over tp (and the shared expert: column/row parallel); the experts
        declared for expert parallelism (``mlp``, its ``experts``, dim 0 = expert)."""
        if getattr(self, "_layout", None) is None:
            cfg = self.config
            col = TPLinear("column", granule=cfg.head_dim)
            block_tp = {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                        "self_attn.o_proj": TPLinear("row")}
            divides = {"n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head}
            if cfg.moe_shared_intermediate_size:
                block_tp.update({"mlp.shared_expert.gate_proj": TPLinear("column"),
                                 "mlp.shared_expert.up_proj": TPLinear("column"),
                                 "mlp.shared_expert.down_proj": TPLinear("row")})
                divides["intermediate_size"] = cfg.moe_shared_intermediate_size
            self._layout = ModelLayout(
                blocks="model.layers", embedding=("model.embed_tokens",), head=("model.norm", "lm_head"),
                token_embedding="model.embed_tokens", output="lm_head",
                tied=(("lm_head.weight", "model.embed_tokens.weight"),) if cfg.tie_word_embeddings else (),
                block_tp=block_tp, attention="self_attn", width=cfg.n_embd, vocab_size=cfg.vocab_size,
                tp_divides=divides,
                experts=ExpertLayout(moe="mlp", experts="mlp.experts", n_experts=cfg.n_experts,
                                     top_k=cfg.experts_top_k))
        return self._layout
