"""What a model family tells the parallel engine about itself: its layout description.

``zerotron.parallel`` names no model. Every strategy (ZeRO flat-buffer units and stage-3 gathering,
FSDP2 wrapping, tensor/sequence parallelism, pipeline stages, activation recomputation, tied-weight
bookkeeping) reads a :class:`ModelLayout` that the model returns from ``model.layout()``. A new model
family ships one next to its module (see ``gpt.py`` and ``llama.py``) and needs no parallel code.

Dotted paths are module paths relative to the model (``"transformer.h"``); ``block_tp`` and
``attention`` are relative to one block. The contract a model keeps besides the layout is
documented on :class:`zerotron.models.base.CausalLM`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

__all__ = ["TPLinear", "ExpertLayout", "ModelLayout", "TP_SIZES", "tp_refusal", "a2a_refusal", "ep_inference_refusal",
           "get_module", "set_module", "retie", "scale_aux_losses", "add_token_sum", "persistent_buffers",
           "load_buffers"]

# The model sizes a tensor-parallel degree must divide, in the order they are checked, and why
# (Shoeybi et al. 2019: attention heads and the MLP's column-parallel width are split evenly).
TP_SIZES = {
    "n_head": "each tp rank holds whole attention heads",
    "n_kv_head": "each tp rank holds whole key/value heads (they are split, not replicated)",
    "intermediate_size": "the MLP matrices are split evenly",
}


def _divisors(n: int, limit: int = 12) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:limit])) + (", ..." if len(ds) > limit else "")


def tp_refusal(tp: int, sizes: Mapping[str, int], seq_len: int | None = None, *,
               tp_name: str = "parallel.tp", seq_name: str = "model.block_size",
               sp_name: str = "parallel.sequence_parallel") -> str | None:
    """The tensor-parallel divisibility rule, stated once: why ``tp`` cannot split this model, or
    None when it can. Every layer that decides it calls this (``ParallelPlan``, the strategies
    through :meth:`ModelLayout.check_tp`, the memory/activation estimators, the planner, the CLI).

    ``tp`` must be >= 1 and divide each size of ``sizes`` named in :data:`TP_SIZES` (n_head, and
    for families that have them n_kv_head and intermediate_size; other keys are ignored, so a whole
    ``config.model_shape`` dict can be passed; GPT-2's MLP width 4C needs no entry: n_head | C).
    ``seq_len``: under sequence parallelism the sequence length that is split over tp (None = no
    sequence parallelism). The reason is one line naming the setting (``tp_name``, ``seq_name``,
    ``sp_name``: how the caller's user spells them) and the fix. Pure Python, no torch."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return f"{tp_name} must be an int >= 1, got {tp!r}"
    present = [(name, sizes[name]) for name in TP_SIZES if sizes.get(name) is not None]
    for name, size in present:
        if size % tp:
            g = math.gcd(*(s for _, s in present))
            return (f"{tp_name} ({tp}) must divide model.{name} ({size}): {TP_SIZES[name]}; choose {tp_name} "
                    f"among {_divisors(g)}")
    if seq_len is not None and seq_len % tp:
        return (f"{sp_name} needs {seq_name} ({seq_len}) divisible by {tp_name} ({tp}) (the sequence is split "
                f"over the tp ranks): change one of them, or turn {sp_name} off")
    return None


def a2a_refusal(cp: int, tp: int, sizes: Mapping[str, int]) -> str | None:
    """The head rule of all-to-all (Ulysses) context parallelism, beside the tp rule it extends: why
    ``parallel.cp_impl = a2a`` cannot re-shard this model's heads over ``cp``, or None when it can.
    After tensor parallelism each tp rank holds n_kv_head / tp key/value heads (n_head / tp for a
    family without grouped-query attention, GPT-2); the all-to-all trades the sequence split for a
    head split, so ``cp`` must divide that count (Jacobs et al. 2023, "DeepSpeed Ulysses"). Assumes
    :func:`tp_refusal` passed. Pure Python."""
    kv = sizes.get("n_kv_head") or sizes.get("n_head")
    if kv is None or cp <= 1:
        return None
    if (kv // tp) % cp:
        name = "n_kv_head" if sizes.get("n_kv_head") else "n_head"
        return (f"parallel.cp_impl = a2a needs parallel.cp ({cp}) to divide the key/value heads per tp rank "
                f"(model.{name} / parallel.tp = {kv} / {tp} = {kv // tp}): the all-to-all re-shards heads over cp; "
                f"use parallel.cp_impl = ring or allgather, or a cp among {_divisors(kv // tp)}")
    return None


def ep_inference_refusal(ep: int, world: int, tp: int, pp: int, sizes: Mapping[str, int], *,
                         ep_name: str = "--parallel.ep", split: str = "replica") -> str | None:
    """Why generation/serving cannot split this model's experts over ``ep`` ranks of a ``world``
    of processes with ``tp`` x ``pp`` model parallelism, or None when it can (the inference rule
    beside the training one in ``ParallelPlan._check_experts``). ``ep`` must be an int >= 1; for
    ep > 1 the model must have experts (``sizes["n_experts"]``), ep must divide them, tp and pp
    must be 1 (the ep groups are carved out of the data-parallel ranks, as in training) and ep must
    divide the world size; ``split`` (``--ep-split``: "replica" or "tokens",
    ``zerotron.parallel.expert.inference``) other than "replica" needs ep > 1. One line naming the
    option and the fix. Pure Python."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return f"{ep_name} must be an int >= 1, got {ep!r}"
    if ep == 1:
        return None if split == "replica" else (f"--ep-split {split} chooses how the ranks of an ep group share the "
                                                f"decoding and needs {ep_name} > 1; set {ep_name} or drop --ep-split")
    n = sizes.get("n_experts") or 0
    if not n:
        return f"{ep_name} {ep} splits the experts of a mixture-of-experts model, and this model has none; drop {ep_name}"
    if n % ep:
        return (f"{ep_name} ({ep}) must divide model.n_experts ({n}): each ep rank holds E/ep whole experts; "
                f"choose {ep_name} among {_divisors(n)}")
    if tp != 1 or pp != 1:
        return (f"{ep_name} > 1 runs with data parallelism only so far (no --parallel.tp or --parallel.pp); "
                f"set them to 1 or drop {ep_name}")
    if world % ep:
        return f"{ep_name} ({ep}) must divide the number of processes ({world}): the ep groups are carved out of them; change --nproc"
    return None


@dataclass(frozen=True)
class TPLinear:
    """How one ``nn.Linear`` of a block splits over the tensor-parallel group (Shoeybi et al. 2019,
    "Megatron-LM", sec. 3).

    ``style="column"``: output features (weight rows, bias) are split; the layer's input is the
    replicated activation, its output this rank's slice. ``style="row"``: input features (weight
    columns) are split; the output is summed over tp (the bias added once). ``chunks``: the output
    dim is ``chunks`` equal stacked parts (3 for a fused [q | k | v]) each split over tp, so every
    rank keeps its own part of each. ``granule``: a split must not cut a group of this many output
    features (the head dim, so each rank holds whole heads); only informative for validation."""

    style: Literal["column", "row"]
    chunks: int = 1
    granule: int = 1


# the Linear projections of a block per model family (paths relative to the block): what LoRA may
# adapt; each family's ModelLayout.block_tp names exactly these (tests/test_finetune.py checks it).
# Plain data (no torch) so the plan can check train.lora_targets before any process exists.
PROJECTIONS = {
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}
ATTENTION_PREFIX = {"gpt2": "attn.", "llama": "self_attn."}


def projection_widths(arch: str, shape: dict) -> dict[str, tuple[int, int]]:
    """``{path: (in_features, out_features)}`` of each projection in :data:`PROJECTIONS` for a resolved
    model shape (``config.model_shape``: ``n_embd``, ``n_head``; llama also ``n_kv_head`` and
    ``intermediate_size``). Plain arithmetic (no torch), for the plan's LoRA rank check."""
    d = int(shape["n_embd"])
    if arch == "gpt2":
        return {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}
    kv = int(shape["n_kv_head"]) * (d // int(shape["n_head"]))
    f = int(shape["intermediate_size"])
    return {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (d, d), "mlp.gate_proj": (d, f), "mlp.up_proj": (d, f), "mlp.down_proj": (f, d)}


def lora_targets(arch: str, spec: str) -> tuple[str, ...]:
    """The block projections ``spec`` names (comma-separated; a name matches a projection's
    full path, e.g. ``mlp.c_proj``, or its last part, e.g. ``q_proj`` or ``c_proj`` = both);
    "" = the attention projections. Raises ValueError (one line) for a name no projection has, or
    for a family without LoRA support (mixtral: its MLP is the experts)."""
    if arch not in PROJECTIONS:
        raise ValueError(f"train.lora_rank > 0 (LoRA) supports the dense families {' and '.join(PROJECTIONS)}, "
                         f"not model.arch = {arch!r}; set train.lora_rank = 0")
    allp = PROJECTIONS[arch]
    if not spec.strip():
        return tuple(p for p in allp if p.startswith(ATTENTION_PREFIX[arch]))
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        hit = [p for p in allp if p == name or p.rsplit(".", 1)[-1] == name]
        if not hit:
            raise ValueError(f"train.lora_targets names {name!r}, which the {arch} model layout does not have; "
                             f"use some of {', '.join(allp)} (or their last parts)")
        out += [p for p in hit if p not in out]
    return tuple(out)


@dataclass(frozen=True)
class ExpertLayout:
    """What expert parallelism needs to know about a mixture-of-experts model (paths relative to a
    block): ``moe`` the MoE module -- it has a ``dispatch`` attribute, a callable ``(experts, rows,
    counts) -> outputs`` taking rows (M, C) sorted by expert with ``counts`` (n_experts,) int64 and
    returning the experts' outputs (M, C) in the same order, which expert parallelism replaces by
    its all-to-all; ``experts`` the module whose parameters are expert-local, each stacked with
    dim 0 = expert (sharded over ep in contiguous ranges), called ``experts(rows, counts)`` with rows
    sorted by the experts it holds and ``counts`` rows per held expert; ``n_experts`` E and ``top_k`` k.
    The ``moe`` module also has ``aux_loss_scale`` (float, 1 by default), the factor the gradient of
    its auxiliary losses is multiplied by (:func:`scale_aux_losses`)."""

    moe: str
    experts: str
    n_experts: int
    top_k: int


@dataclass(frozen=True)
class ModelLayout:
    """The parallel-facing description of a decoder-only causal LM.

    Fields (all module paths dotted, relative to the model unless said otherwise):
      * ``blocks``: the ``nn.ModuleList`` of residual blocks; block ``i`` maps (B, T, C) -> (B, T, C)
        and is called ``block(x, kv_cache)``. ZeRO/FSDP2 units, pipeline stages and recomputation
        are made of whole blocks.
      * ``embedding``: modules run before block 0 (pipeline stage 0); ``head``: modules run after
        the last block (last stage). Together with ``blocks`` they hold every parameter.
      * ``token_embedding``: the ``nn.Embedding`` over the vocabulary (vocab-parallel under TP).
      * ``output``: the ``nn.Linear`` (C -> V) producing logits (column-parallel over the
        vocabulary under TP; with a tied head its weight is the token embedding's).
      * ``tied``: pairs (alias, owner) of parameter names that are the same ``nn.Parameter`` (the
        owner is the name ``named_parameters`` reports).
      * ``block_tp``: the Linear modules of a block (paths relative to the block) and their
        :class:`TPLinear` split; Linear modules not listed stay replicated.
      * ``attention``: the attention submodule of a block (selective recomputation; it exposes the
        ``dropout_rng`` hook, see ``CausalLM``).
      * ``tp_divides``: the model's sizes a tensor-parallel degree must divide, named as in
        :data:`TP_SIZES`, e.g. ``{"n_head": 12, "n_kv_head": 4}``; :func:`tp_refusal` decides.
      * ``width``: C, the channels of the activation between blocks (pipeline buffers).
      * ``vocab_size``: V, the real vocabulary (logits beyond it are padding under TP).
      * ``experts``: an :class:`ExpertLayout` for a mixture-of-experts model, else None.
    """

    blocks: str
    embedding: tuple[str, ...]
    head: tuple[str, ...]
    token_embedding: str
    output: str
    block_tp: Mapping[str, TPLinear]
    attention: str
    width: int
    vocab_size: int
    tied: tuple[tuple[str, str], ...] = ()
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    experts: ExpertLayout | None = None

    def __post_init__(self):
        unknown = set(self.tp_divides) - set(TP_SIZES)
        if unknown:
            raise ValueError(f"ModelLayout.tp_divides names {sorted(unknown)}; the tensor-parallel rule "
                             f"(tp_refusal) knows {list(TP_SIZES)}: add the size there with its reason")

    def check_tp(self, tp: int) -> None:
        """Raise ValueError with :func:`tp_refusal`'s reason when ``tp`` cannot split ``tp_divides``."""
        reason = tp_refusal(tp, self.tp_divides)
        if reason:
            raise ValueError(reason)

    def tied_owner(self) -> dict[str, str]:
        """alias parameter name -> owner parameter name."""
        return dict(self.tied)


def scale_aux_losses(root, factor: float) -> int:
    """Multiply the gradient of every auxiliary loss under ``root`` (each module with an
    ``aux_loss_scale``, the MoE layers of :class:`ExpertLayout`) by ``factor``: a synchroniser that
    pre-scales the token loss (FSDP2 averages gradients over dp, so the loss is divided by
    N_global / dp) must scale the losses a layer adds inside the backward alike, or their gradient
    would be averaged, not summed, over dp. Returns the number of modules set."""
    n = 0
    for m in root.modules():
        if hasattr(m, "aux_loss_scale"):
            m.aux_loss_scale = float(factor)
            n += 1
    return n


@contextlib.contextmanager
def untracked_statistics(root):
    """Forwards run inside this context leave the statistics kept over the step's tokens by the
    modules under ``root`` as they were (the MoE layers of :class:`ExpertLayout`, each with
    ``aux_loss_scale``: their router ``stats`` and ``dropped`` count): for a probe forward that is
    not part of the step, e.g. torch pipelining's shape inference on its first step."""
    saved = [(m, m.stats, m.dropped) for m in root.modules() if hasattr(m, "aux_loss_scale")]
    try:
        yield
    finally:
        for m, stats, dropped in saved:
            m.stats, m.dropped = stats, dropped


def add_token_sum(root, total) -> int:
    """Tell every module under ``root`` that takes statistics over a forward's tokens (each with a
    ``token_sum`` attribute: the MoE layers of :class:`ExpertLayout`, whose auxiliary losses need
    f_i and P_i over each micro-batch's tokens) that this rank holds only part of the positions of
    its sequences: ``total(t) -> t'`` sums a tensor over the ranks holding the rest (sequence
    parallelism over tp, context parallelism over cp; not differentiable). Composes with one
    already set (cp outside tp: both sums). Returns the number of modules set."""
    n = 0
    for m in root.modules():
        if hasattr(m, "token_sum"):
            prev = m.token_sum
            m.token_sum = total if prev is None else (lambda t, f=total, g=prev: f(g(t)))
            n += 1
    return n


# the wrapper segments torch's ``get_state_dict`` leaves out of an FQN (DDP, torch.compile, checkpoint wrappers)
_WRAPPERS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def persistent_buffers(root) -> dict:
    """``{fqn: tensor}`` of the persistent buffers under ``root`` (e.g. the MoE layers'
    ``expert_bias``), keyed as in a dense ``root.state_dict()`` with wrapper segments (DDP's
    ``module.``, torch.compile's ``_orig_mod.``) dropped: the model state a checkpoint holds besides
    the parameters. Non-persistent buffers (RoPE tables) and ``None`` entries are left out; a buffer
    reachable under two names is listed under the first. The tensors are the live buffers."""
    out, seen = {}, set()
    for prefix, m in root.named_modules():
        for name, b in m._buffers.items():
            if b is None or name in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            fqn = ".".join(p for p in f"{prefix}.{name}".split(".") if p and p not in _WRAPPERS)
            out[fqn] = b
    return out


def load_buffers(root, state: dict) -> list[str]:
    """Copy the entries of ``state`` ({fqn: tensor}, a canonical model state) that name persistent
    buffers of ``root`` (:func:`persistent_buffers`) into them (device and dtype of the buffer).
    Returns the names of the buffers ``state`` lacks (they keep their values). Raises ValueError
    for a shape that does not fit."""
    import torch  # not at module level: the plan's checks import this module without torch

    missing = []
    with torch.no_grad():
        for fqn, b in persistent_buffers(root).items():
            if fqn not in state:
                missing.append(fqn)
                continue
            src = state[fqn]
            if src.shape != b.shape:
                raise ValueError(f"{fqn}: saved shape {tuple(src.shape)} != the model's {tuple(b.shape)}")
            if src is not b:
                b.copy_(src.to(device=b.device, dtype=b.dtype))
    return missing


def get_module(root, path: str):
    """The submodule of ``root`` at dotted ``path`` ("" is root). Raises AttributeError if absent."""
    m = root
    for part in path.split(".") if path else []:
        m = getattr(m, part)
    return m


def set_module(root, path: str, module) -> None:
    """Replace (or register) the submodule of ``root`` at dotted ``path`` with ``module``."""
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent), name, module)


def retie(model, layout: ModelLayout) -> None:
    """Make every (alias, owner) pair of ``layout.tied`` the same Parameter again in ``model`` (e.g.
    after ``to_empty``, which creates new Parameters). Raises AttributeError for a missing name."""
    for alias, owner in layout.tied:
        omod, _, oname = owner.rpartition(".")
        amod, _, aname = alias.rpartition(".")
        setattr(get_module(model, amod), aname, getattr(get_module(model, omod), oname))
