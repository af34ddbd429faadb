"""The layout space of the parity matrix: the factors and every layout of their product
(``layout``), the plan's verdict on each and the documented reasons for the refused ones
(``refusals``), the named witnesses (``witnesses``), the pairwise covering arrays (``covering``)
and the mixture-of-experts family (``moe``); see the package docstring, ``zerotron.parity``.
Every name is importable from here."""
from .covering import covering_layouts, joint_covering
from .layout import (
    FACTORS,
    FP64_RTOL,
    GLOBAL_BATCH,
    LORA_TRAIN,
    MAX_WORLD,
    MODEL,
    MODELS,
    STEPS,
    TORCH_KINDS,
    TRAIN,
    Layout,
    all_layouts,
    config_for,
)
from .moe import EP, MOE_MICRO_BATCH, MOE_MODEL, MOE_MUST, MOE_MUST_FULL, moe_expected_refusal, moe_layouts, moe_refusal
from .refusals import expected_refusal, refusal
from .witnesses import (
    DOC_MASK,
    LORA,
    LORA_CI,
    MUST,
    OFFLOAD,
    doc_corpus,
    doc_mask_layouts,
    lora_layouts,
    offload_layouts,
    witness_families,
)

__all__ = ["FACTORS", "FP64_RTOL", "GLOBAL_BATCH", "MAX_WORLD", "MODEL", "MODELS", "STEPS", "TORCH_KINDS", "TRAIN",
           "Layout", "all_layouts", "config_for", "expected_refusal", "refusal", "DOC_MASK", "LORA", "LORA_CI",
           "LORA_TRAIN", "MUST", "OFFLOAD", "doc_corpus", "doc_mask_layouts", "lora_layouts", "offload_layouts",
           "witness_families", "covering_layouts", "joint_covering", "EP", "MOE_MICRO_BATCH", "MOE_MODEL",
           "MOE_MUST", "MOE_MUST_FULL", "moe_expected_refusal", "moe_layouts", "moe_refusal"]
