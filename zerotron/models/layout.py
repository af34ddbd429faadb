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

from dataclasses import dataclass, field
from typing import Literal, Mapping

__all__ = ["TPLinear", "ModelLayout", "get_module", "set_module", "retie"]


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
      * ``tp_divides``: named sizes a tensor-parallel degree must divide, e.g. ``{"n_head": 12,
        "n_kv_head": 4}``; a tp that does not divide one is refused naming it.
      * ``width``: C, the channels of the activation between blocks (pipeline buffers).
      * ``vocab_size``: V, the real vocabulary (logits beyond it are padding under TP).
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

    def check_tp(self, tp: int) -> None:
        """Raise ValueError naming the first size in ``tp_divides`` that ``tp`` does not divide."""
        for name, size in self.tp_divides.items():
            if size % tp:
                raise ValueError(f"tensor parallel degree tp={tp} must divide {name}={size} (each rank "
                                 f"holds {name}/tp whole parts); choose tp among the divisors of {size}")

    def tied_owner(self) -> dict[str, str]:
        """alias parameter name -> owner parameter name."""
        return dict(self.tied)


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
