"""Hugging Face Mixtral checkpoints (config.json + safetensors) <-> zerotron ``Mixtral``.

The checkpoint format (what the hub holds and what transformers 5 still writes with
``save_pretrained``): Llama's names for attention and norms; per layer
``model.layers.N.block_sparse_moe.gate.weight`` (E, C) and one Linear per expert,
``block_sparse_moe.experts.e.w1.weight`` (gate, F x C), ``w3`` (up, F x C), ``w2`` (down, C x F).
zerotron stacks the experts (``mlp.experts.gate_proj`` = stack of w1 over e, ``up_proj`` of w3,
``down_proj`` of w2) and names the router ``mlp.gate``. transformers 5's in-memory form
(``mlp.experts.gate_up_proj`` (E, 2F, C) = [w1; w3] per expert, ``mlp.experts.down_proj``) is read
too. Everything else is Llama's (``hf_llama``: RoPE in both config forms, tied heads).

Mixtral's router is softmax over all E logits, top-k, renormalised -- zerotron's ``topk_softmax``.
Refused (one line): ``router_jitter_noise`` > 0, ``num_experts_per_tok`` > ``num_local_experts``,
a ``sliding_window`` shorter than ``max_position_embeddings``, and Llama's refusals.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from .hf import _check_keys, _eos_id, load_hf_model, write_hf_dir
from .hf_llama import _ROPE_BUFFER, _rope_from_hf, llama_to_hf_config, tie_head
from .mixtral import Mixtral, MixtralConfig

__all__ = ["hf_config_to_mixtral", "mixtral_to_hf_config", "state_dict_from_hf_mixtral",
           "state_dict_to_hf_mixtral", "load_hf_mixtral", "export_hf_mixtral"]

_LEGACY = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_config_to_mixtral(config: dict) -> MixtralConfig:
    """Map a HF MixtralConfig dict (config.json contents) to a validated MixtralConfig.

    Llama's fields as ``hf_llama.hf_config_to_llama`` reads them, plus ``num_local_experts`` ->
    n_experts, ``num_experts_per_tok`` -> experts_top_k, ``router_aux_loss_coef`` ->
    moe_aux_loss_coef. Missing fields take HF's defaults (the 8x7B shape). Raises ValueError
    (one line listing every problem) for model_type other than mixtral, hidden_act other than
    silu, head_dim != hidden/heads, router_jitter_noise > 0, top-k > experts, a sliding window
    shorter than the context, an unsupported RoPE type, or invalid sizes."""
    c = dict(config)
    problems = []
    if c.get("model_type", "mixtral") != "mixtral":
        problems.append(f"model_type={c['model_type']!r} (only 'mixtral')")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (only 'silu': SwiGLU experts)")
    hidden, heads = c.get("hidden_size", 4096), c.get("num_attention_heads", 32)
    if c.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={c['head_dim']} (only hidden_size/num_attention_heads={hidden // heads})")
    experts, top_k = c.get("num_local_experts", 8), c.get("num_experts_per_tok", 2)
    if float(c.get("router_jitter_noise", 0.0) or 0.0) > 0:
        problems.append(f"router_jitter_noise={c['router_jitter_noise']} (unsupported router: only the "
                        "plain top-k softmax router, jitter 0)")
    if isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        problems.append(f"num_experts_per_tok={top_k} > num_local_experts={experts} (unsupported router)")
    block = c.get("max_position_embeddings", 4096 * 32)
    window = c.get("sliding_window")
    if window is not None and window < block:
        problems.append(f"sliding_window={window} < max_position_embeddings={block} (full attention only)")
    try:
        theta, scaling = _rope_from_hf(c)
    except ValueError as e:
        problems.append(str(e).removeprefix("unsupported Llama config setting: "))
    if problems:
        raise ValueError("unsupported Mixtral config setting(s): " + "; ".join(problems))
    return MixtralConfig(
        vocab_size=c.get("vocab_size", 32000), block_size=block, n_layer=c.get("num_hidden_layers", 32),
        n_head=heads, n_kv_head=c.get("num_key_value_heads") or heads, n_embd=hidden,
        intermediate_size=c.get("intermediate_size", 14336), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        dropout=float(c.get("attention_dropout", 0.0) or 0.0),
        n_experts=experts, experts_top_k=top_k, moe_router="topk_softmax",
        moe_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
    ).validate()


def mixtral_to_hf_config(cfg: MixtralConfig, eos_token_id: int | None = None) -> dict:
    """The config.json of ``cfg`` as ``transformers.MixtralConfig`` reads it. Raises ValueError for
    what Mixtral's format cannot express: a shared expert, the ``softmax_topk`` router, a z-loss
    weight (not stored: a warning-free omission would change training), or an invalid cfg."""
    cfg.validate()
    if cfg.moe_shared_intermediate_size or cfg.moe_router != "topk_softmax":
        raise ValueError("MixtralForCausalLM has no shared expert and only the topk_softmax router: set "
                         "model.moe_shared_intermediate_size = 0 and model.moe_router = 'topk_softmax' to export")
    if cfg.moe_bias_update_rate:
        raise ValueError("MixtralForCausalLM has no expert-selection bias (model.moe_bias_update_rate > 0 trained one, "
                         "which changes the routing): export a model trained with model.moe_bias_update_rate = 0")
    out = llama_to_hf_config(cfg, eos_token_id)
    for key in ("pretraining_tp", "mlp_bias", "attention_bias"):
        out.pop(key, None)
    out.update({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_top_k,
                "router_aux_loss_coef": cfg.moe_aux_loss_coef, "router_jitter_noise": 0.0,
                "output_router_logits": False, "sliding_window": None})
    return out


def _expected_shapes(cfg: MixtralConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Mixtral(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def state_dict_from_hf_mixtral(hf_sd: dict[str, torch.Tensor], cfg: MixtralConfig) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors (checkpoint or transformers-5 form) -> a ``Mixtral(cfg)`` state dict.

    Per-expert w1/w3/w2 are stacked over e into gate_proj/up_proj/down_proj; a fused
    ``gate_up_proj`` is split in halves. Tied heads as in ``hf_llama``. Raises ValueError on
    missing experts, missing/unexpected keys or wrong shapes."""
    out, experts = {}, {}
    for key, t in hf_sd.items():
        if _ROPE_BUFFER.search(key):
            continue
        name = key if key.startswith(("model.", "lm_head.")) else "model." + key
        m = _LEGACY.match(name)
        if m:
            experts.setdefault((m.group(1), _STACKED[m.group(3)]), {})[int(m.group(2))] = t
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
            continue
        out[name] = t.contiguous()
    for (layer, stacked), per in experts.items():
        if sorted(per) != list(range(cfg.n_experts)):
            raise ValueError(f"{layer}: experts {sorted(per)} found, expected 0..{cfg.n_experts - 1} "
                             "(num_local_experts in config.json)")
        out[f"{layer}.mlp.experts.{stacked}"] = torch.stack([per[e] for e in range(cfg.n_experts)])
    tie_head(out, cfg.tie_word_embeddings)
    _check_keys(out, _expected_shapes(cfg), "HF Mixtral state dict")
    return out


def state_dict_to_hf_mixtral(sd: dict[str, torch.Tensor], cfg: MixtralConfig) -> dict[str, torch.Tensor]:
    """A Mixtral state dict -> HF checkpoint tensors (``block_sparse_moe``, one w1/w2/w3 per
    expert; a tied ``lm_head.weight`` left out). Detached contiguous CPU copies sharing no storage.
    Raises ValueError on key/shape mismatch."""
    _check_keys(sd, _expected_shapes(cfg), "Mixtral state dict")
    inverse = {v: k for k, v in _STACKED.items()}
    out = {}
    for name, t in sd.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        layer, sep, rest = name.partition(".mlp.")
        if sep and rest.startswith("experts."):
            w = inverse[rest.removeprefix("experts.")]
            for e in range(t.size(0)):
                out[f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = t[e].contiguous().clone()
            continue
        if sep:
            name = f"{layer}.block_sparse_moe.{rest}"
        out[name] = t.contiguous().clone()
    return out


def load_hf_mixtral(path: str | Path, meta: bool = False) -> Mixtral:
    """Build a Mixtral from a HF Mixtral checkpoint (directory or .safetensors file with config.json
    beside it; see ``hf.load_hf_model``), eval mode. Raises FileNotFoundError for a missing
    path/file, ValueError for an unsupported config or weights that do not match it."""
    return load_hf_model(path, "HF Mixtral", hf_config_to_mixtral, state_dict_from_hf_mixtral, Mixtral, meta=meta)


def export_hf_mixtral(model_or_state_dict: Mixtral | dict, cfg: MixtralConfig | None, out_dir: str | Path,
                      *, overwrite: bool = False, eos_token_id: int | None = None) -> Path:
    """Write ``out_dir`` readable by ``transformers.MixtralForCausalLM.from_pretrained``; return it.
    Errors as ``hf_llama.export_hf_llama``, plus :func:`mixtral_to_hf_config`'s refusals."""
    if isinstance(model_or_state_dict, Mixtral):
        cfg = cfg or model_or_state_dict.config
        sd = model_or_state_dict.state_dict()
    else:
        sd = model_or_state_dict
    if cfg is None:
        raise ValueError("export_hf_mixtral needs cfg when given a state dict")
    if eos_token_id is not None:
        _eos_id(cfg, eos_token_id)
    return write_hf_dir(out_dir, state_dict_to_hf_mixtral(sd, cfg), mixtral_to_hf_config(cfg, eos_token_id),
                        overwrite)
