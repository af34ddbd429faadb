"""PEFT LoRA adapter directories: read one (``adapter_config.json`` + ``adapter_model.safetensors``,
the files ``peft``'s ``save_pretrained`` and ``zerotron export --adapter`` write), check it against a
model, and fold it into the model's weights for inference (``serve`` / ``generate --adapter``).

The adapter's tensors are named ``base_model.model.<module>.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r), where ``<module>`` is the Hugging Face module name; zerotron's GPT-2
and Llama modules carry the same names (``transformer.h.0.attn.c_attn``,
``model.layers.0.self_attn.q_proj``). LoRA (Hu et al. 2021, arXiv:2106.09685) adds
``scaling · B A`` to the weight, scaling = ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``, Kalajdzievski 2023, arXiv:2312.03732). GPT-2's Conv1D layers hold W transposed
(in, out), which is why peft stores them with ``fan_in_fan_out = true``; its A and B keep the
(r, in) / (out, r) shapes, so they apply to zerotron's ``nn.Linear`` (out, in) as they are.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

__all__ = ["read_adapter", "adapter_deltas", "merge_adapter", "peft_targets"]

PREFIX = "base_model.model."
UNSUPPORTED = (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained extra modules)"),
               ("rank_pattern", "rank_pattern (per-module ranks)"), ("alpha_pattern", "alpha_pattern (per-module alphas)"),
               ("layers_to_transform", "layers_to_transform"), ("target_parameters", "target_parameters"),
               ("lora_bias", "lora_bias (a bias on lora_B)"))


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of a peft LoRA directory. Raises ValueError (one line) for a
    missing directory or file, invalid JSON, a non-LoRA adapter or an option not supported here
    (DoRA, modules_to_save, rank/alpha patterns, bias other than "none")."""
    d = Path(path)
    conf_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not conf_file.is_file():
        raise ValueError(f"--adapter {str(d)!r} has no adapter_config.json; give a peft adapter directory "
                         "(peft save_pretrained or zerotron export --adapter)")
    if not weights.is_file():
        extra = " (adapter_model.bin: re-save with safe_serialization=True)" if (d / "adapter_model.bin").is_file() else ""
        raise ValueError(f"--adapter {str(d)!r} has no adapter_model.safetensors{extra}")
    try:
        conf = json.loads(conf_file.read_text())
    except ValueError as e:
        raise ValueError(f"--adapter {str(conf_file)!r} is not valid JSON ({e})") from None
    if not isinstance(conf, dict) or conf.get("peft_type") != "LORA":
        raise ValueError(f"--adapter {str(d)!r}: peft_type {conf.get('peft_type') if isinstance(conf, dict) else None!r}"
                         " is not LORA; only LoRA adapters can be applied")
    for key, what in UNSUPPORTED:
        if conf.get(key):
            raise ValueError(f"--adapter {str(d)!r} uses {what}, which zerotron does not apply; save the adapter "
                             f"without {key}")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"--adapter {str(d)!r} trains biases (bias = {conf['bias']!r}); only bias = 'none' is applied")
    if not isinstance(conf.get("r"), int) or conf["r"] < 1:
        raise ValueError(f"--adapter {str(d)!r}: adapter_config.json r must be an int >= 1, got {conf.get('r')!r}")
    alpha = conf.get("lora_alpha", conf["r"])
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        # was: "could not convert string to float: 'x'" (naming neither the adapter nor the field), and NaN
        # scaled every delta to NaN without a word
        raise ValueError(f"--adapter {str(d)!r}: adapter_config.json lora_alpha must be a finite number, got {alpha!r}")
    t = conf.get("target_modules")
    if isinstance(t, str):
        try:
            re.compile(t)
        except re.error as e:  # peft reads a string as a regular expression
            raise ValueError(f"--adapter {str(d)!r}: adapter_config.json target_modules {t!r} is not a valid regular "
                             f"expression ({e})") from None
    elif t is not None and not (isinstance(t, list) and all(isinstance(k, str) for k in t)):
        raise ValueError(f"--adapter {str(d)!r}: adapter_config.json target_modules must be a list of module names "
                         f"or a regular expression, got {t!r}"[:300])
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: one line
        raise ValueError(f"--adapter {str(weights)!r} cannot be read as safetensors ({e})") from None
    return conf, tensors


def _targets_match(conf: dict, name: str) -> bool:
    """peft's rule: ``target_modules`` a string is a regular expression matched against the whole
    module name; a list matches a name equal to an entry or ending in ``.entry``."""
    t = conf.get("target_modules")
    if isinstance(t, str):
        return re.fullmatch(t, name) is not None
    return bool(t) and any(name == k or name.endswith("." + k) for k in t)


def adapter_deltas(model: nn.Module, conf: dict, tensors: dict[str, torch.Tensor],
                   where: str = "--adapter") -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module name: (A (r, in), B (out, r), scaling)}`` of an adapter checked against ``model``
    (any device, also meta). Raises ValueError (one line) for a tensor name that is not a LoRA
    weight, a module the model does not have or that is not a Linear (unknown target module), a
    ``target_modules`` entry that matches no module, A/B shapes that differ from the module's
    weight (base mismatch), or A/B ranks that differ from each other or from ``r`` (rank mismatch)."""
    modules = dict(model.named_modules())
    r = int(conf["r"])
    alpha = float(conf.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(re.escape(PREFIX) + r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight (base_model.model.<module>.lora_A/B.weight)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    t = conf.get("target_modules")
    for k in ([t] if isinstance(t, str) else t or []):
        hit = (any(re.fullmatch(k, n) for n in modules) if isinstance(t, str)
               else any(n == k or n.endswith("." + k) for n in modules))
        if not hit:
            raise ValueError(f"{where}: target_modules names {k!r}, which this model does not have (its projections "
                             f"are e.g. {_examples(model)}); the adapter was trained for another model family")
    out = {}
    for name, ab in sorted(pairs.items()):
        lin = modules.get(name)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{where}: the adapter targets module {name!r}, which this model "
                             f"{'does not have' if lin is None else 'has, but not as a Linear layer'} "
                             f"(its projections are e.g. {_examples(model)}); the adapter belongs to another model")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: module {name!r} has lora_{''.join(ab)} but not its pair; the adapter file is incomplete")
        a, b = ab["A"], ab["B"]
        out_f, in_f = lin.weight.shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f:
            raise ValueError(f"{where}: base mismatch at {name!r}: the adapter's A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)} fit a ({b.shape[0] if b.dim() == 2 else '?'} x "
                             f"{a.shape[1] if a.dim() == 2 else '?'}) weight, the checkpoint's is ({out_f} x {in_f}); "
                             "serve the adapter on the base it was trained on")
        if a.shape[0] != b.shape[1] or a.shape[0] != r:
            raise ValueError(f"{where}: rank mismatch at {name!r}: A has rank {a.shape[0]}, B {b.shape[1]}, "
                             f"adapter_config.json r = {r}; the adapter files do not belong together")
        if not _targets_match(conf, name):
            raise ValueError(f"{where}: module {name!r} has adapter weights but target_modules "
                             f"{conf.get('target_modules')!r} does not name it; the adapter files do not belong together")
        out[name] = (a, b, scaling)
    return out


def _examples(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


@torch.no_grad()
def merge_adapter(model: nn.Module, path: str | Path) -> list[str]:
    """Fold the peft LoRA adapter at ``path`` into ``model``'s weights (W += scaling · B A,
    computed in float64, cast to the weight's dtype); returns the adapted module names. The model
    must be dense (a LoRA checkpoint merged first). Raises ValueError (see :func:`read_adapter`,
    :func:`adapter_deltas`)."""
    conf, tensors = read_adapter(path)
    deltas = adapter_deltas(model, conf, tensors)
    modules = dict(model.named_modules())
    for name, (a, b, s) in deltas.items():
        w = modules[name].weight
        w.copy_((w.double() + (b.double() @ a.double()).to(w.device) * s).to(w.dtype))
    return list(deltas)


def peft_targets(model: nn.Module, adapted: list[str]) -> list[str]:
    """peft ``target_modules`` that select exactly the modules ``adapted`` of ``model`` (names as
    Hugging Face's): for each, its shortest dotted suffix that no other, un-adapted module of the
    model ends with (``q_proj`` for Llama; ``attn.c_proj`` for GPT-2 when ``mlp.c_proj`` is not
    adapted). Sorted, without duplicates."""
    names = [n for n, _ in model.named_modules() if n]
    chosen = set(adapted)
    out = set()
    for n in adapted:
        parts = n.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if all(m in chosen for m in names if m == suffix or m.endswith("." + suffix)):
                out.add(suffix)
                break
    return sorted(out)
