"""Model families by name: ``"gpt2"``, ``"llama"`` and ``"mixtral"`` -> config class, model class, presets and HF
converters. The CLI, trainer, generation, export and the estimators go through here instead of
naming a model class, so a new family is one entry (its module keeps the layout description).

Preset names are unique across families ("tiny" is GPT-2, "llama-tiny" Llama), so a preset alone
names its family. Checkpoints record the family as ``model_config["arch"]`` (:func:`config_meta`);
a checkpoint without it is GPT-2 (written before Llama existed).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..fields import field_defaults
from . import gpt, hf, hf_llama, hf_mixtral, llama, mixtral
from .base import CausalLM

__all__ = ["Arch", "ARCHS", "DEFAULT_ARCH", "get_arch", "arch_of", "preset_arch", "all_presets",
           "preset_config", "build_model", "config_meta", "config_from_meta", "hf_arch", "hf_config", "load_hf",
           "export_hf", "make_config"]

DEFAULT_ARCH = "gpt2"


@dataclass(frozen=True)
class Arch:
    """One model family: ``config_cls`` (a dataclass with ``validate()``), ``model_cls`` (a
    :class:`CausalLM` taking that config), ``presets`` (name -> config fields), ``hf_model_type``
    (config.json ``model_type``), ``load_hf(path, meta=False) -> model`` (meta: headers only, on
    the meta device) and ``export_hf(model, cfg, out_dir, overwrite=, eos_token_id=) -> Path``
    (Hugging Face safetensors directories)."""

    name: str
    config_cls: type
    model_cls: type
    presets: Mapping[str, dict]
    hf_model_type: str
    load_hf: Callable
    export_hf: Callable


ARCHS: dict[str, Arch] = {
    "gpt2": Arch("gpt2", gpt.GPTConfig, gpt.GPT, gpt.PRESETS, "gpt2", hf.load_hf_gpt2, hf.export_hf_gpt2),
    "llama": Arch("llama", llama.LlamaConfig, llama.Llama, llama.PRESETS, "llama",
                  hf_llama.load_hf_llama, hf_llama.export_hf_llama),
    "mixtral": Arch("mixtral", mixtral.MixtralConfig, mixtral.Mixtral, mixtral.PRESETS, "mixtral",
                    hf_mixtral.load_hf_mixtral, hf_mixtral.export_hf_mixtral),
}


def get_arch(name: str) -> Arch:
    """The family ``name``. Raises ValueError listing the known ones."""
    if name not in ARCHS:
        raise ValueError(f"unknown model architecture {name!r}; valid: {', '.join(ARCHS)}")
    return ARCHS[name]


def arch_of(cfg_or_model) -> str:
    """Family name of a config or model instance. Raises TypeError for anything else."""
    cfg = getattr(cfg_or_model, "config", cfg_or_model)
    for arch in ARCHS.values():  # the exact class: MixtralConfig is a LlamaConfig
        if type(cfg) is arch.config_cls:
            return arch.name
    raise TypeError(f"not a zerotron model or model config: {type(cfg_or_model).__name__}")


def all_presets() -> dict[str, str]:
    """preset name -> family name, over every family."""
    return {p: a.name for a in ARCHS.values() for p in a.presets}


def preset_arch(name: str) -> str:
    """Family of preset ``name``. Raises ValueError listing every preset."""
    presets = all_presets()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(presets)}")
    return presets[name]


def preset_config(name: str, **overrides):
    """The validated config (of its family's class) of preset ``name`` with ``overrides``.
    Raises ValueError for an unknown preset or an invalid result."""
    arch = get_arch(preset_arch(name))
    return arch.config_cls(**{**copy.deepcopy(dict(arch.presets[name])), **overrides}).validate()


def make_config(arch: str, **fields):
    """``get_arch(arch).config_cls(**fields).validate()``; TypeError for a field the family lacks."""
    return get_arch(arch).config_cls(**fields).validate()


def build_model(cfg) -> CausalLM:
    """A freshly initialised model of ``cfg``'s family (uses torch's RNG, like the classes)."""
    return get_arch(arch_of(cfg)).model_cls(cfg)


def config_meta(cfg) -> dict:
    """The checkpoint form of ``cfg``: its fields plus ``"arch"``."""
    return {"arch": arch_of(cfg), **dataclasses.asdict(cfg)}


def config_from_meta(meta_cfg: dict):
    """Inverse of :func:`config_meta`; a dict without ``"arch"`` is GPT-2 (older checkpoints).
    Unknown keys are ignored. Raises ValueError for an unknown family or invalid sizes."""
    arch = get_arch(meta_cfg.get("arch", DEFAULT_ARCH))
    names = {f.name for f in dataclasses.fields(arch.config_cls)}
    return arch.config_cls(**{k: v for k, v in meta_cfg.items() if k in names}).validate()


def hf_arch(path: str | Path) -> str:
    """Family of a HF checkpoint (directory or .safetensors file with config.json beside it),
    from config.json's ``model_type``. Raises FileNotFoundError without config.json, ValueError for
    a config.json that is not JSON or a model_type no family reads."""
    p = Path(path)
    config = (p if p.is_dir() else p.parent) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} not found: a Hugging Face checkpoint needs its config.json "
                                "next to the weights")
    try:
        meta = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # name the file, not only the position
        raise ValueError(f"{config} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{config} must hold a JSON object, got {type(meta).__name__}")
    model_type = meta.get("model_type", "gpt2")
    for arch in ARCHS.values():
        if arch.hf_model_type == model_type:
            return arch.name
    known = ", ".join(a.hf_model_type for a in ARCHS.values())
    raise ValueError(f"{config}: model_type {model_type!r} is not supported (supported: {known})")


def hf_config(path: str | Path):
    """The validated family config of a HF checkpoint: what :func:`load_hf` would build, checked
    against the names and shapes of its weights (safetensors headers only, a model on the meta
    device: no tensor is read). Raises FileNotFoundError without config.json or weights (or when
    ``path`` is neither a directory nor a .safetensors file), ValueError for an unknown
    model_type, a setting the family does not implement, invalid sizes, or weights that do not
    match config.json."""
    return get_arch(hf_arch(path)).load_hf(path, meta=True).config


def load_hf(path: str | Path) -> CausalLM:
    """The model of a HF checkpoint, its family from config.json (eval mode). Errors as
    :func:`hf_arch` and the family's loader."""
    return get_arch(hf_arch(path)).load_hf(path)


def export_hf(model: CausalLM, out_dir: str | Path, *, overwrite: bool = False,
              eos_token_id: int | None = None) -> Path:
    """Write ``model`` as a HF checkpoint of its family (GPT2LMHeadModel / LlamaForCausalLM)."""
    return get_arch(arch_of(model)).export_hf(model, None, out_dir, overwrite=overwrite,
                                              eos_token_id=eos_token_id)


# ---- the [model] config section -> a family's config (duck-typed: zerotron.config_sections.ModelConfig) ----

DEFAULT_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
SIZE_FIELDS = tuple(DEFAULT_SHAPE)
# fields whose default 0 means "unset" (take the preset's / the default value): an explicit 0 is refused
UNSET_IS_ZERO = SIZE_FIELDS + ("n_kv_head", "intermediate_size", "rope_theta", "rms_norm_eps", "n_experts",
                               "experts_top_k")
LLAMA_FIELDS = ("n_kv_head", "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps")
MOE_FIELDS = ("n_experts", "experts_top_k", "moe_router", "moe_shared_intermediate_size", "moe_aux_loss_coef",
              "moe_z_loss_coef", "moe_capacity_factor", "moe_bias_update_rate")
MOE_DEFAULTS = {"n_experts": 8, "experts_top_k": 2, "moe_router": "topk_softmax", "moe_shared_intermediate_size": 0,
                "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.0, "moe_capacity_factor": 0.0,
                "moe_bias_update_rate": 0.0}


def _given(m, name: str) -> bool:
    """Whether section ``m`` sets field ``name``: ``m.given(name)`` when it tracks that (values from
    TOML/CLI), else the value differs from the dataclass default."""
    if hasattr(m, "given"):
        return m.given(name)
    return getattr(m, name) != field_defaults(type(m))[name]


def section_arch(m) -> str:
    """The family a model section selects: ``model.arch`` if set, else the preset's family, else
    ``m.arch`` (default gpt2). Raises ValueError for an unknown arch or preset, or an arch that
    contradicts the preset's."""
    if m.preset and m.preset not in all_presets():
        raise ValueError(f"model.preset {m.preset!r} is unknown; valid presets: {', '.join(all_presets())}")
    family = preset_arch(m.preset) if m.preset else None
    if _given(m, "arch"):
        get_arch(m.arch)
        if family and family != m.arch:
            raise ValueError(f"model.preset {m.preset!r} is a {family} preset but model.arch = {m.arch!r}; "
                             f"set model.arch = {family!r} or leave it out")
        return m.arch
    return family or m.arch


def resolve_shape(m) -> dict:
    """The resolved shape of a model section: ``{"arch", "n_layer", "n_head", "n_embd",
    "block_size", "bias"}`` (+ ``"vocab_size"`` if the preset fixes one; + for llama
    ``n_kv_head, intermediate_size, rope_theta, rope_scaling, rms_norm_eps, tie_word_embeddings``).
    Precedence: non-zero / set fields, then the preset, then the defaults (sizes 4/4/128/128;
    llama: n_kv_head = n_head, Meta's intermediate_size rule, rope_theta 1e4, no rope scaling,
    rms_norm_eps 1e-5, untied). Raises ValueError (one line, naming the field) for an unknown
    arch/preset, a size field set to 0 explicitly (TOML or CLI; 0 is only the "unset" default), a
    llama field with gpt2, bias true with llama, or an untied gpt2."""
    arch = section_arch(m)
    zero = [f"model.{k}" for k in UNSET_IS_ZERO if _given(m, k) and not getattr(m, k)]
    if zero:  # 0 stands for "unset": written out, it silently meant the preset's or default value
        source = f"the value of preset {m.preset!r}" if m.preset else "the default"
        raise ValueError(f"{', '.join(zero)} = 0 is not a size: set it >= 1, or leave it out of the config and "
                         f"flags to take {source}")
    shape = {"arch": arch, **DEFAULT_SHAPE}
    if m.preset:
        shape.update({k: v for k, v in copy.deepcopy(dict(get_arch(arch).presets[m.preset])).items()
                      if k != "dropout"})
    for key in SIZE_FIELDS:
        if getattr(m, key):
            shape[key] = getattr(m, key)
    moe_given = [f"model.{f}" for f in MOE_FIELDS if _given(m, f)]
    if arch != "mixtral" and moe_given:
        raise ValueError(f"{', '.join(moe_given)} applies to model.arch = 'mixtral' only; remove it or set "
                         "model.arch = 'mixtral'")
    if arch == "gpt2":
        extra = [f"model.{f}" for f in LLAMA_FIELDS if getattr(m, f)]
        if extra:
            raise ValueError(f"{', '.join(extra)} applies to model.arch = 'llama' only; remove it or set "
                             "model.arch = 'llama'")
        if _given(m, "tie_word_embeddings") and not m.tie_word_embeddings:
            raise ValueError("model.tie_word_embeddings = false is not available for gpt2 (GPT-2 ties its "
                             "output head to the token embedding); remove it")
        return {**shape, "bias": m.bias}
    if _given(m, "bias") and m.bias:
        raise ValueError("model.bias = true is not available for model.arch = 'llama' (Llama has no "
                         "biases); remove it or set it false")
    shape.setdefault("n_kv_head", shape["n_head"])
    shape.setdefault("intermediate_size", llama.default_intermediate_size(shape["n_embd"]))
    shape.setdefault("rope_theta", 10000.0)
    shape.setdefault("rope_scaling", None)
    shape.setdefault("rms_norm_eps", 1e-5)
    shape.setdefault("tie_word_embeddings", False)
    for key in ("n_kv_head", "intermediate_size", "rope_theta", "rms_norm_eps"):
        if getattr(m, key):
            shape[key] = getattr(m, key)
    if m.rope_scaling:
        try:
            shape["rope_scaling"] = llama.parse_rope_scaling(m.rope_scaling)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None
    if _given(m, "tie_word_embeddings"):
        shape["tie_word_embeddings"] = m.tie_word_embeddings
    if arch == "mixtral":  # set fields (non-zero / given), then the preset, then MOE_DEFAULTS
        for key, default in MOE_DEFAULTS.items():
            shape.setdefault(key, default)
            if _given(m, key) and (getattr(m, key) or key.endswith("_coef")):
                shape[key] = getattr(m, key)
    return {**shape, "bias": False}


def config_from_section(m, vocab_size: int):
    """The validated family config of model section ``m`` with ``vocab_size`` rows (the caller's
    choice: model.vocab_size or the tokenizer's) and ``m.dropout``. Raises ValueError."""
    shape = resolve_shape(m)
    arch = shape.pop("arch")
    shape.pop("vocab_size", None)
    return make_config(arch, vocab_size=vocab_size, dropout=m.dropout, **shape)
