"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685).

A targeted ``nn.Linear`` y = x Wᵀ (+ b) keeps its frozen weight and gains two trainable matrices,
``lora_A`` (r, in) and ``lora_B`` (out, r), registered on the Linear itself (state-dict names
``<proj>.lora_A`` / ``<proj>.lora_B``: the base names stay those of the dense model, so
checkpoints, pipeline stages and export see the same keys), and a forward hook adds
``(alpha / r) · dropout(x) Aᵀ Bᵀ``. A is initialised Kaiming-uniform (a = √5, as ``nn.Linear``
and the ``peft`` library), B to zero, so training starts from the base model exactly. Every other
parameter of the model is frozen (``requires_grad = False``): no gradient, no optimizer state, and
the data-parallel synchronisers skip it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layout import get_module, lora_targets

__all__ = ["apply_lora", "merge_lora", "has_lora", "adapter_state", "lora_modules", "lora_kwargs", "peft_config"]


def lora_kwargs(train: dict) -> dict:
    """:func:`apply_lora`'s keyword arguments from a ``train`` config section as a dict (a live
    ``TrainConfig`` via ``dataclasses.asdict``, or a checkpoint's ``meta["config"]["train"]``)."""
    return {"rank": int(train.get("lora_rank", 0)), "alpha": float(train.get("lora_alpha", 0.0)),
            "dropout": float(train.get("lora_dropout", 0.0)), "targets": train.get("lora_targets", ""),
            "seed": int(train.get("seed", 0))}


def peft_config(model: nn.Module, rank: int, alpha: float, dropout: float, base: str = "",
                fan_in_fan_out: bool = False) -> dict:
    """``adapter_config.json`` of ``model``'s adapters for the ``peft`` library (LORA, CAUSAL_LM;
    target_modules: the shortest name suffixes that select exactly the adapted projections, see
    ``peft_adapter.peft_targets``; ``fan_in_fan_out`` true for GPT-2, whose HF layers are Conv1D)."""
    from .peft_adapter import peft_targets

    targets = peft_targets(model, list(lora_modules(model)))
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2.0 * rank,
            "lora_dropout": dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": fan_in_fan_out,
            "inference_mode": True, "base_model_name_or_path": base, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None}


def _hook(module: nn.Linear, inputs, output):
    x = inputs[0]
    drop = module.lora_dropout
    if drop > 0 and module.training:
        x = F.dropout(x, drop, True)
    return output + F.linear(F.linear(x, module.lora_A), module.lora_B) * module.lora_scaling


def lora_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """``{name: Linear}`` of the model's adapted projections, in module order."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}


def has_lora(model: nn.Module) -> bool:
    """True if some projection of ``model`` carries an adapter."""
    return bool(lora_modules(model))


def apply_lora(model: nn.Module, arch: str, rank: int, alpha: float = 0.0, dropout: float = 0.0,
               targets: str = "", seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` (a dense CausalLM) and add adapters of rank ``rank`` to
    the projections ``targets`` names (see ``layout.lora_targets``) in every block.

    ``alpha`` 0 means 2 x rank; ``seed`` seeds A's initialisation (a private generator: every rank
    and layout gets the same adapters). The adapters take the base weight's dtype and device.
    Returns the adapted module names. Raises ValueError for rank < 1 or an unknown target."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    paths = lora_targets(arch, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    blocks = get_module(model, model.layout().blocks)
    names = []
    for i, block in enumerate(blocks):
        for path in paths:
            lin = get_module(block, path)
            w = lin.weight
            a = torch.empty(rank, w.shape[1], dtype=torch.float64)
            bound = math.sqrt(6.0 / ((1 + 5.0) * w.shape[1]))  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in)
            a.uniform_(-bound, bound, generator=gen)
            lin.lora_A = nn.Parameter(a.to(w.dtype).to(w.device))
            lin.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))
            lin.lora_scaling = (alpha or 2.0 * rank) / rank
            lin.lora_dropout = float(dropout)
            lin.lora_handle = lin.register_forward_hook(_hook)
            names.append(f"{model.layout().blocks}.{i}.{path}")
    return names


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += (alpha / r) B A, in float64 then cast) and
    remove the adapters; returns ``model`` (a plain dense model again, parameters still frozen)."""
    for m in lora_modules(model).values():
        delta = (m.lora_B.double() @ m.lora_A.double()) * m.lora_scaling
        m.weight.copy_((m.weight.double() + delta).to(m.weight.dtype))
        m.lora_handle.remove()
        del m.lora_A, m.lora_B
        del m.lora_scaling, m.lora_dropout, m.lora_handle
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as the ``peft`` library names them in ``adapter_model.safetensors``:
    ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r),
    contiguous CPU copies. Valid for models whose module names are Hugging Face's (GPT-2, Llama; GPT-2's
    Conv1D layers take the same (r, in) / (out, r) shapes, see ``peft_adapter``)."""
    out = {}
    for n, m in lora_modules(model).items():
        out[f"base_model.model.{n}.lora_A.weight"] = m.lora_A.detach().cpu().contiguous().clone()
        out[f"base_model.model.{n}.lora_B.weight"] = m.lora_B.detach().cpu().contiguous().clone()
    return out
