"""Hugging Face Llama checkpoints (config.json + safetensors) <-> zerotron ``Llama``.

HF ``LlamaForCausalLM`` uses the same module names and the same (out, in) Linear layout as
``zerotron.models.llama.Llama``, so weights convert by name without any transpose. Handled here:
a tied checkpoint omits ``lm_head.weight``; old checkpoints may carry the RoPE buffer
``model.layers.N.self_attn.rotary_emb.inv_freq`` / ``model.rotary_emb.inv_freq`` (recomputed,
dropped). RoPE settings come in two config.json forms, both read and both written: transformers 4.x
``rope_theta`` + ``rope_scaling``, and 5.x ``rope_parameters`` (``rope_type``, ``rope_theta``, the
scaling keys). Only safetensors files are read (no pickle); ``transformers`` is not needed here.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from .hf import _check_keys, _eos_id, load_hf_model, write_hf_dir
from .llama import Llama, LlamaConfig, check_rope_scaling

__all__ = ["hf_config_to_llama", "llama_to_hf_config", "state_dict_from_hf_llama",
           "state_dict_to_hf_llama", "load_hf_llama", "export_hf_llama"]

_ROPE_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_from_hf(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config.json form; ValueError for a RoPE type
    other than default/llama3."""
    params, legacy = c.get("rope_parameters") or {}, c.get("rope_scaling") or {}
    for name, val in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(val, dict):
            raise ValueError(f"{name} must be a dict, got {val!r}")

    def kind_of(d: dict) -> str:
        return d.get("rope_type") or d.get("type") or "default"
    # both forms may be present (transformers 5 writes rope_parameters, 4.x rope_scaling): a
    # scaling in either one counts, and two different scalings are refused
    kinds = {kind_of(params), kind_of(legacy)} - {"default"}
    if len(kinds) > 1:
        raise ValueError(f"unsupported Llama config setting: rope_parameters ({kind_of(params)!r}) and rope_scaling "
                         f"({kind_of(legacy)!r}) disagree")
    source = params if kind_of(params) != "default" else legacy
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"unsupported Llama config setting: rope_theta={theta} (must be a finite number > 0)")
    kind = kind_of(source)
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"unsupported Llama config setting: RoPE type {kind!r} (zerotron implements "
                         "default RoPE and rope_type 'llama3' only)")
    scaling = {"rope_type": "llama3", **{k: source[k] for k in _SCALING_KEYS if k in source}}
    check_rope_scaling(scaling)
    return theta, scaling


def hf_config_to_llama(config: dict) -> LlamaConfig:
    """Map a HF LlamaConfig dict (config.json contents) to a validated LlamaConfig.

    block_size comes from ``max_position_embeddings``, n_kv_head from ``num_key_value_heads``
    (absent = num_attention_heads), dropout from ``attention_dropout``. Missing fields take HF's
    LlamaConfig defaults (the Llama-2-7B shape). Raises ValueError for settings this
    implementation lacks: model_type other than llama, hidden_act other than silu,
    attention_bias/mlp_bias true, head_dim != hidden_size/num_attention_heads, a RoPE type other
    than default/llama3 (linear, dynamic, yarn, longrope, ...); or for invalid sizes."""
    c = dict(config)
    problems = []
    if c.get("model_type", "llama") != "llama":
        problems.append(f"model_type={c['model_type']!r} (only 'llama')")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (only 'silu': SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag, False):
            problems.append(f"{flag}=true (Llama here has no biases)")
    hidden, heads = c.get("hidden_size", 4096), c.get("num_attention_heads", 32)
    if c.get("head_dim") not in (None, hidden // heads):
        absent = [k for k in ("hidden_size", "num_attention_heads") if k not in c]
        problems.append(f"head_dim={c['head_dim']} (only hidden_size/num_attention_heads={hidden // heads}"
                        + (f"; {' and '.join(absent)} absent from config.json: HF's default taken" if absent else "")
                        + ")")
    try:
        theta, scaling = _rope_from_hf(c)
    except ValueError as e:
        problems.append(str(e).removeprefix("unsupported Llama config setting: "))
    if problems:
        raise ValueError("unsupported Llama config setting(s): " + "; ".join(problems))
    return LlamaConfig(
        vocab_size=c.get("vocab_size", 32000), block_size=c.get("max_position_embeddings", 2048),
        n_layer=c.get("num_hidden_layers", 32), n_head=heads,
        n_kv_head=c.get("num_key_value_heads") or heads, n_embd=hidden,
        intermediate_size=c.get("intermediate_size", 11008), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        dropout=float(c.get("attention_dropout", 0.0) or 0.0),
    ).validate()


def llama_to_hf_config(cfg: LlamaConfig, eos_token_id: int | None = None) -> dict:
    """A config.json dict for ``transformers.LlamaForCausalLM.from_pretrained`` (4.x and 5.x: RoPE is
    written in both forms). ``eos_token_id``: the tokenizer's end-of-text id, written as bos and eos
    (None: null, no ordinary token taken for it). zerotron's residual dropout has no HF counterpart:
    ``dropout`` is written as ``attention_dropout`` only (it matters in training alone). Raises
    ValueError if cfg is invalid or eos_token_id is not an id of the vocabulary."""
    cfg.validate()
    eos = _eos_id(cfg, eos_token_id) if eos_token_id is not None else None
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**{k: cfg.rope_scaling[k] for k in _SCALING_KEYS}, "rope_type": "llama3",
                "rope_theta": cfg.rope_theta}
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.block_size,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling else None,
        "rope_parameters": rope, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": cfg.dropout, "initializer_range": 0.02, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_word_embeddings, "use_cache": True,
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None,
    }


def tie_head(out: dict, tied: bool) -> None:
    """HF import of a tied config (Llama and its descendants): a missing ``lm_head.weight`` in
    ``out`` (HF key names) is filled with ``model.embed_tokens.weight``; a present one must equal it
    (or be on the meta device). Raises ValueError when it differs."""
    emb = out.get("model.embed_tokens.weight")
    if tied and emb is not None:
        head = out.get("lm_head.weight")
        if head is not None and (head.shape != emb.shape or not (head.is_meta or torch.equal(head, emb))):
            raise ValueError("lm_head.weight differs from model.embed_tokens.weight but config.json says "
                             "tie_word_embeddings=true")
        out["lm_head.weight"] = emb


def _expected_shapes(cfg: LlamaConfig) -> dict[str, torch.Size]:
    """Our state-dict key -> shape, from a Llama built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def state_dict_from_hf_llama(hf_sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF Llama tensors -> a state dict for ``Llama(cfg).load_state_dict`` (same keys).

    Keys may lack the ``model.`` prefix (a bare ``LlamaModel``). RoPE ``inv_freq`` buffers are
    dropped. Tied: a missing ``lm_head.weight`` is filled with the embedding, a present one must
    equal it. Raises ValueError on missing/unexpected keys, wrong shapes, or a tied config whose
    lm_head differs from the embedding."""
    out = {}
    for key, t in hf_sd.items():
        if _ROPE_BUFFER.search(key):
            continue
        name = key if key.startswith(("model.", "lm_head.")) else "model." + key
        out[name] = t.contiguous()
    tie_head(out, cfg.tie_word_embeddings)
    _check_keys(out, _expected_shapes(cfg), "HF Llama state dict")
    return out


def state_dict_to_hf_llama(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our Llama state dict -> HF LlamaForCausalLM tensors (same names; a tied ``lm_head.weight``
    left out, as transformers writes it). Every tensor is a detached, contiguous CPU copy sharing no
    storage (safetensors refuses shared tensors). Raises ValueError on key/shape mismatch."""
    _check_keys(sd, _expected_shapes(cfg), "Llama state dict")
    return {name: t.detach().cpu().contiguous().clone() for name, t in sd.items()
            if not (cfg.tie_word_embeddings and name == "lm_head.weight")}


def load_hf_llama(path: str | Path, meta: bool = False) -> Llama:
    """Build a Llama from a HF Llama checkpoint (a directory with config.json and
    model.safetensors or a sharded model.safetensors.index.json, or a .safetensors file with
    config.json beside it). Returns the model in eval mode (weights cast to its fp32 parameters).
    Raises FileNotFoundError naming a missing path/file, ValueError for an unsupported config or
    weights that do not match it. ``meta``: headers only, a model on the meta device (see
    ``hf.load_hf_model``)."""
    return load_hf_model(path, "HF Llama", hf_config_to_llama, state_dict_from_hf_llama, Llama, meta=meta)


def export_hf_llama(model_or_state_dict: Llama | dict, cfg: LlamaConfig | None, out_dir: str | Path,
                    *, overwrite: bool = False, eos_token_id: int | None = None) -> Path:
    """Write ``out_dir/config.json``, ``generation_config.json`` and ``model.safetensors`` readable
    by ``transformers.LlamaForCausalLM.from_pretrained(out_dir)``; return out_dir. ``cfg`` may be
    None when a Llama is passed. Tensors keep their dtype. Raises FileExistsError if out_dir is a
    file or a non-empty directory and not ``overwrite``; ValueError if cfg is missing or does not
    match the weights, or eos_token_id is outside the vocabulary."""
    if isinstance(model_or_state_dict, Llama):
        cfg = cfg or model_or_state_dict.config
        sd = model_or_state_dict.state_dict()
    else:
        sd = model_or_state_dict
    if cfg is None:
        raise ValueError("export_hf_llama needs cfg when given a state dict")
    hf_config = llama_to_hf_config(cfg, eos_token_id)
    return write_hf_dir(out_dir, state_dict_to_hf_llama(sd, cfg), hf_config, overwrite)
