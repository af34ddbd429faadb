"""Hugging Face GPT-2 checkpoints (config.json + safetensors) <-> zerotron ``GPT``; the checkpoint
reading/writing helpers shared with ``hf_llama`` (Llama).

HF ``GPT2LMHeadModel`` uses the same module names as ``zerotron.models.gpt.GPT``, with two
differences handled here: its ``Conv1D`` layers (c_attn, c_proj, c_fc) store weights as
(in_features, out_features), the transpose of ``nn.Linear``; and its files may carry the
non-parameter buffers ``h.N.attn.bias`` / ``h.N.attn.masked_bias`` (old causal masks) and omit the
tied ``lm_head.weight``. Only safetensors files are read (no pickle). ``transformers`` is not
needed by this module.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zerotron.models.gpt import GPT, GPTConfig

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFER = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def hf_config_to_gpt(config: dict) -> GPTConfig:
    """Map a HF GPT2Config dict (config.json contents) to a validated GPTConfig.

    block_size comes from ``n_positions`` (or the older ``n_ctx``); dropout from ``resid_pdrop``
    (HF also has embd_pdrop/attn_pdrop, equal by default; they only matter in training).
    Missing fields take the GPT2Config defaults (the 124M model).
    Raises ValueError for settings this architecture does not implement: model_type other than
    gpt2, activation_function other than gelu_new/gelu_pytorch_tanh, n_inner != 4*n_embd,
    scale_attn_weights false, scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn true,
    add_cross_attention true, or untied word embeddings; or for invalid sizes.
    """
    c = dict(config)
    problems = []
    if c.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type={c['model_type']!r} (only 'gpt2')")
    if c.get("activation_function", "gelu_new") not in _GELU_TANH:
        problems.append(f"activation_function={c['activation_function']!r} "
                        f"(supported: {', '.join(_GELU_TANH)})")
    n_embd = c.get("n_embd", 768)
    if c.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner={c['n_inner']} (only 4*n_embd={4 * n_embd})")
    if not c.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                 "add_cross_attention"):
        if c.get(flag, False):
            problems.append(f"{flag}=true")
    if not c.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings=false (lm_head must share the wte weight)")
    if problems:
        raise ValueError("unsupported GPT-2 config setting(s): " + "; ".join(problems))
    return GPTConfig(
        vocab_size=c.get("vocab_size", 50257),
        block_size=c.get("n_positions", c.get("n_ctx", 1024)),
        n_layer=c.get("n_layer", 12), n_head=c.get("n_head", 12), n_embd=n_embd,
        dropout=float(c.get("resid_pdrop", 0.1)), bias=True,
        layer_norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
    ).validate()


def _eos_id(cfg: GPTConfig, eos_token_id: int | None) -> int | None:
    """The end-of-text id to write: ``eos_token_id`` if given (checked to be in the vocabulary),
    else 50256 (GPT-2's <|endoftext|>) when vocab_size >= 50257, else None (unknown)."""
    if eos_token_id is None:
        return 50256 if cfg.vocab_size >= 50257 else None
    if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int) \
            or not 0 <= eos_token_id < cfg.vocab_size:
        raise ValueError(f"eos_token_id must be a token id in [0, {cfg.vocab_size}), got {eos_token_id!r}")
    return eos_token_id


def gpt_to_hf_config(cfg: GPTConfig, eos_token_id: int | None = None) -> dict:
    """A config.json dict for ``transformers.GPT2LMHeadModel.from_pretrained``.

    ``eos_token_id``: the tokenizer's end-of-text id (``<|endoftext|>``), written as both bos and
    eos id (GPT-2 uses one token for both). When None: 50256 (GPT-2's) if vocab_size >= 50257,
    else null, so that no ordinary token is taken for end-of-text (transformers then generates
    up to the requested length). Raises ValueError if cfg has bias=False (HF GPT-2 always has
    biases) or is invalid, or if eos_token_id is not an id of the vocabulary.
    """
    cfg.validate()
    if not cfg.bias:
        raise ValueError("HF GPT-2 always has Linear/LayerNorm biases; cannot export bias=False")
    eos = _eos_id(cfg, eos_token_id)
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "use_cache": True, "bos_token_id": eos, "eos_token_id": eos,
        "tie_word_embeddings": True,
    }


def _expected_shapes(cfg: GPTConfig) -> dict[str, torch.Size]:
    """Our state-dict key -> shape, from a GPT built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def _check_keys(got: dict, expected: dict, what: str) -> None:
    """Raise ValueError listing missing/unexpected keys and shape mismatches (first few each)."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [f"{k}: got {tuple(got[k].shape)}, expected {tuple(expected[k])}"
             for k in expected if k in got and got[k].shape != expected[k]]
    if missing or unexpected or wrong:
        parts = [f"{name} ({len(items)}): {items[:5]}" for name, items in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                 if items]
        raise ValueError(f"{what} does not match the model config: " + "; ".join(parts)
                         + ". Check that config.json belongs to these weights.")


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors -> a state dict for ``GPT(cfg).load_state_dict``.

    Keys may have the ``transformer.`` prefix (GPT2LMHeadModel) or not (GPT2Model). Conv1D
    weights (in, out) are transposed to Linear (out, in). Mask buffers are dropped. A missing
    ``lm_head.weight`` is filled with wte (tied); a present one must equal wte.
    Raises ValueError on missing/unexpected keys, wrong shapes, or untied lm_head.
    """
    out = {}
    for key, t in hf_sd.items():
        if _MASK_BUFFER.search(key):
            continue
        name = key.removeprefix("transformer.")
        if name != "lm_head.weight":
            name = "transformer." + name
        if name.endswith(_CONV1D) and t.dim() == 2:
            t = t.t()
        out[name] = t.contiguous()
    wte = out.get("transformer.wte.weight")
    if "lm_head.weight" in out and wte is not None:
        head = out["lm_head.weight"]
        if head.shape != wte.shape or not (head.is_meta or torch.equal(head, wte)):  # (meta: shapes only)
            raise ValueError("lm_head.weight differs from transformer.wte.weight; only tied "
                             "GPT-2 checkpoints are supported")
    if wte is not None:
        out["lm_head.weight"] = wte
    _check_keys(out, _expected_shapes(cfg), "HF GPT-2 state dict")
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our GPT state dict -> HF GPT2LMHeadModel tensors (``transformer.*`` keys).

    Linear weights of c_attn/c_proj/c_fc are transposed to Conv1D (in, out); the tied
    ``lm_head.weight`` is left out. Every tensor is a detached, contiguous CPU copy that shares
    no storage (safetensors refuses shared tensors). Raises ValueError on key/shape mismatch.
    """
    _check_keys(sd, _expected_shapes(cfg), "GPT state dict")
    out = {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        if name.endswith(_CONV1D):
            t = t.t()
        out[name] = t.contiguous().clone()
    return out


def _header_tensors(path: str) -> dict[str, torch.Tensor]:
    """Meta tensors of the names, shapes and dtypes in a safetensors file's header (no data read).
    Raises ValueError (one line naming the file) for a file whose header cannot be read (truncated,
    overwritten, not safetensors)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    try:
        f = safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"not a readable safetensors file, truncated or damaged ({str(e).strip().splitlines()[0]}) "
                         f"in {path}") from None
    with f:
        for k in f.keys():
            sl = f.get_slice(k)
            dtype = getattr(torch, {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                                    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                                    "BOOL": "bool"}.get(sl.get_dtype(), "float32"))
            out[k] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    return out


def _read_safetensors(path: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """Load model.safetensors, or the shards listed by model.safetensors.index.json beside it
    (``meta``: meta tensors of the headers only)."""
    load = _header_tensors if meta else load_file
    if path.is_file():
        return load(str(path))
    index = path.with_name(path.name + ".index.json")
    if index.is_file():
        sd = {}
        for shard in _index_shards(index):
            if not path.with_name(shard).is_file():
                raise FileNotFoundError(f"shard {shard} listed in {index} is missing; copy every shard the "
                                        "index lists into the folder")
            sd.update(load(str(path.with_name(shard))))
        return sd
    hint = (" Only safetensors is read: convert pytorch_model.bin with "
            "transformers' save_pretrained(..., safe_serialization=True).")
    raise FileNotFoundError(f"weights file {path} not found.{hint}")


def _index_shards(index: Path) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` lists (sorted, distinct). Raises
    ValueError (one line naming the index) for a file that is not JSON or has no ``weight_map`` of
    file names (e.g. torn by a copy), or for a shard name that leaves the folder."""
    try:
        doc = json.loads(index.read_text())
    except ValueError as e:  # not JSON (a UnicodeDecodeError is a ValueError too)
        raise ValueError(f"{index} is not valid JSON ({str(e).splitlines()[0]}); copy it again from the model's "
                         "source") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to shard files in its folder; copy it again "
                         "from the model's source")
    return sorted(set(weight_map.values()))


def read_hf_checkpoint(path: str | Path, what: str = "HF") -> tuple[Path, dict]:
    """(weights path, config.json contents) of a HF checkpoint: ``path`` is a directory holding
    config.json and model.safetensors (or a sharded model.safetensors.index.json), or a
    .safetensors file with config.json beside it. Raises FileNotFoundError naming what is missing."""
    path = Path(path)
    if path.is_dir():
        weights = path / "model.safetensors"
    elif path.suffix == ".safetensors" and path.is_file():
        weights = path
    else:
        raise FileNotFoundError(f"{path} is neither a checkpoint directory nor a .safetensors "
                                "file; pass the folder written by save_pretrained")
    config_path = weights.parent / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a {what} checkpoint needs its "
                                "config.json next to the weights")
    config = json.loads(config_path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return weights, config


def read_hf_weights(weights: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` (a file, or the shards of its .index.json). Raises
    FileNotFoundError if neither exists."""
    return _read_safetensors(weights)


def load_hf_gpt2(path: str | Path, meta: bool = False) -> GPT:
    """Build a GPT from a HF GPT-2 checkpoint.

    ``path``: a directory holding config.json and model.safetensors (or a sharded
    model.safetensors.index.json), or a .safetensors file with config.json beside it.
    Returns the model in eval mode, float dtype as stored (cast to our fp32 params).
    Raises FileNotFoundError naming a missing path/file, ValueError for an unsupported config or
    weights that do not match it.
    """
    return load_hf_model(path, "HF GPT-2", hf_config_to_gpt, state_dict_from_hf, GPT, meta=meta)


def load_hf_model(path: str | Path, what: str, to_config, to_state_dict, model_cls, meta: bool = False):
    """Shared loader of every family: ``read_hf_checkpoint(path, what)``, ``cfg = to_config(config
    dict)``, ``to_state_dict(hf tensors, cfg)`` loaded into ``model_cls(cfg)``; returns it in eval
    mode. A ValueError of the conversion is re-raised naming the weights file. ``meta``: read
    only the safetensors headers and build the model on the meta device (no weight is read or
    allocated: a launcher's check that config.json and the weights agree in names and shapes);
    a shape mismatch is then a ValueError too."""
    weights, config = read_hf_checkpoint(path, what)
    cfg = to_config(config)
    try:
        sd = to_state_dict(_read_safetensors(weights, meta=meta), cfg)
        if meta:
            with torch.device("meta"):
                model = model_cls(cfg)
            try:
                model.load_state_dict(sd)
            except RuntimeError as e:  # size mismatch for ...: one line of torch's message
                lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
                raise ValueError(lines[0] if lines else str(e).splitlines()[0]) from None
            return model
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
    model = model_cls(cfg)
    model.load_state_dict(sd)
    return model.eval()


def _mode_like_open(path: Path) -> None:
    """Give ``path`` the mode ``open()`` would (0666 minus the umask, usually 0644): safetensors'
    writer creates its file 0600, unlike the json files beside it."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def export_hf_gpt2(model_or_state_dict: GPT | dict, cfg: GPTConfig | None, out_dir: str | Path,
                   *, overwrite: bool = False, eos_token_id: int | None = None) -> Path:
    """Write ``out_dir/config.json``, ``out_dir/generation_config.json`` and
    ``out_dir/model.safetensors`` readable by ``transformers.GPT2LMHeadModel.from_pretrained(out_dir)``;
    return out_dir.

    ``cfg`` may be None when a GPT is passed (its ``.config`` is used). Tensors keep their dtype.
    ``eos_token_id``: the tokenizer's ``<|endoftext|>`` id, written as bos/eos id in both JSON
    files so that ``generate()`` stops there (see :func:`gpt_to_hf_config` for None).
    Raises FileExistsError if out_dir is a file or a non-empty directory and not ``overwrite``;
    ValueError if cfg is missing or does not match the weights, or has bias=False, or
    eos_token_id is outside the vocabulary.
    """
    if isinstance(model_or_state_dict, GPT):
        cfg = cfg or model_or_state_dict.config
        sd = model_or_state_dict.state_dict()
    else:
        sd = model_or_state_dict
    if cfg is None:
        raise ValueError("export_hf_gpt2 needs cfg when given a state dict")
    hf_config = gpt_to_hf_config(cfg, eos_token_id)
    tensors = state_dict_to_hf(sd, cfg)
    return write_hf_dir(out_dir, tensors, hf_config, overwrite)


def write_hf_dir(out_dir: str | Path, tensors: dict, hf_config: dict, overwrite: bool = False) -> Path:
    """Write ``out_dir/config.json`` (``hf_config``), ``generation_config.json`` (its bos/eos ids)
    and ``model.safetensors`` (``tensors``, unshared contiguous CPU tensors); return out_dir.
    Raises FileExistsError if out_dir is a file or a non-empty directory and not ``overwrite``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose another --out directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; choose a new directory or pass "
                              "--overwrite (CLI) / overwrite=True (Python) to replace config.json, "
                              "generation_config.json and model.safetensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _mode_like_open(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir
