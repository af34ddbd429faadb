"""Installing context parallelism on a model: :func:`apply_context_parallel` and its hooks.

The model keeps its code; its :class:`~zerotron.models.base.ParallelHooks` change (``models.base``):
every full-sequence forward receives this cp rank's zigzag chunks of the sequence (the trainer
splits tokens and targets with :func:`.split.split_sequence`), position embeddings and RoPE use the
tokens' global positions (``positions``), and attention runs over the cp group
(``attention`` -> :func:`.attention.context_attention`). Everything else works on the local chunk.
The hooks wrap the ones already installed (tensor parallelism: cp composes outside tp), delegating
what they do not change.
"""
from __future__ import annotations

import torch

from zerotron.distributed import comm
from zerotron.models.base import ParallelHooks, WrappingHooks
from zerotron.models.layout import add_token_sum, get_module
from zerotron.parallel.context.attention import context_attention, shared_dropout
from zerotron.parallel.context.split import zigzag_positions

__all__ = ["CPHooks", "apply_context_parallel"]


class CPHooks(WrappingHooks):
    """The hooks of a context-parallel model over ``group`` (a ``comm.NamedGroup``, the cp group)
    with implementation ``impl`` (``parallel.cp_impl``), on top of ``inner`` (the hooks installed
    before, e.g. tensor parallelism's). Inside ``generation()`` context parallelism is off: every
    cp rank holds the whole model and decodes the whole sequence itself."""

    def __init__(self, inner: ParallelHooks, group, impl: str):
        super().__init__(inner)
        self.group, self.impl = group, impl

    def positions(self, T: int, device=None) -> torch.Tensor | None:
        """(1, T) global positions of this rank's T = T_global / cp local tokens (zigzag)."""
        if not self.active:
            return self.inner.positions(T, device)
        cp = self.group.size()
        return zigzag_positions(T * cp, cp, self.group.rank(), device=device)[None]

    def attention(self, q, k, v, dropout_p: float, pad=None):
        """:func:`context_attention` over the cp group; ``dropout_p`` > 0: coordinate-function
        attention dropout with a key shared over cp (:func:`.attention.shared_dropout`). Raises
        ValueError for what it does not support: a KV cache (k longer than q) or left padding."""
        if not self.active:
            return self.inner.attention(q, k, v, dropout_p, pad)
        if pad is not None or k.size(2) != q.size(2):
            raise ValueError("context-parallel attention runs full-sequence forwards without KV cache or padding; "
                             "decode inside model.parallel_hooks.generation()")
        drop = shared_dropout(dropout_p, self.group) if dropout_p > 0 else None
        return context_attention(q, k, v, self.group, self.impl, drop=drop)


def apply_context_parallel(model, group, impl: str):
    """Make ``model`` (a ``CausalLM`` with a ``layout()``; dense or tensor-parallel) context
    parallel over ``group`` in place: a :class:`CPHooks` on the model and on every block's
    ``layout().attention`` module. Parameters are untouched (replicated over cp; the gradient
    synchroniser reduces them over dp x cp); modules taking statistics over a forward's tokens (MoE
    routers) sum them over cp (``models.layout.add_token_sum``). Sets ``model.cp_group``. Returns the model. Raises
    ValueError if the model is already context parallel."""
    if getattr(model, "cp_group", None) is not None:
        raise ValueError("model is already context-parallel")
    lay = model.layout()
    hooks = CPHooks(model.parallel_hooks, group, impl)
    model.parallel_hooks = hooks
    for block in get_module(model, lay.blocks):
        get_module(block, lay.attention).parallel_hooks = hooks
    add_token_sum(model, comm.summer(group, "moe_aux"))  # MoE routers: statistics over every cp chunk
    model.cp_group = group
    return model
