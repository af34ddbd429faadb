"""Document masking for packed training windows (``data.doc_mask``).

The token streams of ``zerotron.data`` are documents, each followed by the end-of-text separator
(``<|endoftext|>``), cut into fixed windows. With document masking a token attends only to earlier
tokens of its own document (block-diagonal AND causal), and positions (GPT-2's learned positions,
Llama's RoPE) restart at 0 with each document, as Llama 3 trains (Dubey et al. 2024, "The Llama 3
Herd of Models", section 3.2: "an attention mask that prevents self-attention between different
documents within the same sequence").

Conventions:
  * the separator is the **last token of the document it ends** (its document index is the one of
    the tokens before it); the token after it starts a new document at position 0;
  * a window may start or end inside a document: its first tokens are a document of their own,
    starting at position 0 (the window holds nothing earlier to attend to);
  * the loss is unchanged: every target counts, including the separator's target (the first token
    of the next document), which the separator predicts from its own document alone, as the first
    token of any document is predicted -- the same global-token normalisation as without masking.
So packed training equals running each document piece of a window alone (positions 0 ..), summing
the per-piece losses, divided by the same global target count (``tests/test_docmask.py``).

The document indices (B, T) come from the tokens themselves (:func:`document_ids`), so no extra
tensor travels with a micro-batch: a runner wraps each micro-batch's forward and backward (and a
pipeline every F/B/W action, which recompute under activation checkpointing) in
``hooks.documents(x)``. Under context parallelism ``x`` is this rank's zigzag chunks; the tokens
of the whole sequence are all-gathered over the cp group first (``all_gather`` tag ``cp_docs``,
B*T int64 per micro-batch), the indices computed on the natural order, and each attention
implementation masks with them (:mod:`.ring`: per (query chunk, key chunk) block, from the chunks'
global positions; :mod:`.a2a` and :mod:`.allgather`: over the gathered sequence).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zerotron.distributed import comm
from zerotron.models.base import ParallelHooks, WrappingHooks
from zerotron.models.layout import get_module

from .attention import context_attention, shared_dropout
from .documents import doc_attention, document_ids
from .split import split_sequence, unsplit_order

__all__ = ["Documents", "DocMaskHooks", "apply_doc_mask", "document_ids", "doc_attention"]


@dataclass(frozen=True)
class Documents:
    """One micro-batch's documents: ``doc`` (B, T) indices over the whole sequence in natural order,
    ``local_pos`` (B, T_local) the in-document positions of this rank's tokens (T_local = T / cp,
    the zigzag chunks; = T without cp)."""

    doc: torch.Tensor
    local_pos: torch.Tensor


class DocMaskHooks(WrappingHooks):
    """The hooks of a document-masked model (module doc), outermost over ``inner`` (dense, tensor-
    or context-parallel hooks). ``sep``: the separator token id; ``group``/``impl``: the cp group
    and ``parallel.cp_impl`` when the model is context parallel (else None). Inside
    ``generation()`` (a single document) and for KV-cache or padded forwards it delegates to
    ``inner``; a full-sequence training/eval forward outside ``documents(x)`` raises RuntimeError
    (a runner that forgot the micro-batch's documents would silently attend across them)."""

    def __init__(self, inner: ParallelHooks, sep: int, group=None, impl: str = "ring"):
        super().__init__(inner)
        self.sep, self.group, self.impl, self.docs = sep, group, impl, None

    def doc_info(self, x: torch.Tensor) -> Documents:
        """The :class:`Documents` of tokens ``x`` (B, T_local), this rank's part of the micro-batch
        (under cp one ``all_gather`` of the tokens over the cp group, tag ``cp_docs``)."""
        if self.group is None or self.group.size() == 1:
            doc, pos = document_ids(x, self.sep)
            return Documents(doc, pos)
        cp, (B, Tl) = self.group.size(), x.shape
        out = torch.empty(cp * x.numel(), dtype=x.dtype, device=x.device)
        comm.all_gather(out, x.contiguous(), group=self.group, tag="cp_docs")
        full = out.view(cp, B, Tl).permute(1, 0, 2).reshape(B, cp * Tl)
        full = full.index_select(1, unsplit_order(cp * Tl, cp, device=x.device))
        doc, pos = document_ids(full, self.sep)
        return Documents(doc, split_sequence(pos, cp, self.group.rank()))

    @contextlib.contextmanager
    def documents(self, x: torch.Tensor):
        """Context of one micro-batch's forward (and backward) with tokens ``x`` (B, T_local) int64."""
        before, self.docs = self.docs, self.doc_info(x)
        try:
            yield self.docs
        finally:
            self.docs = before

    def _need(self) -> Documents:
        if self.docs is None:
            raise RuntimeError("data.doc_mask: a full-sequence forward ran outside hooks.documents(x); the runner "
                               "must pass each micro-batch's tokens (see zerotron.parallel.context.docmask)")
        return self.docs

    def positions(self, T: int, device=None) -> torch.Tensor | None:
        """(B, T) in-document positions of this rank's T tokens."""
        if not self.active:
            return self.inner.positions(T, device)
        pos = self._need().local_pos
        if pos.size(1) != T:
            raise RuntimeError(f"data.doc_mask: the forward has {T} tokens, its documents {pos.size(1)}")
        return pos.to(device) if device is not None else pos

    def attention(self, q, k, v, dropout_p: float, pad=None):
        """Document-masked causal attention (dense: :func:`doc_attention`; cp: the cp
        implementation with the documents)."""
        if not self.active or pad is not None or k.size(2) != q.size(2):
            return self.inner.attention(q, k, v, dropout_p, pad)
        docs = self._need()
        if self.group is not None and self.group.size() > 1:
            drop = shared_dropout(dropout_p, self.group) if dropout_p > 0 else None
            return context_attention(q, k, v, self.group, self.impl, doc=docs.doc, drop=drop)
        return doc_attention(q, k, v, docs.doc.to(q.device), dropout_p)


def apply_doc_mask(model, sep: int) -> DocMaskHooks:
    """Install :class:`DocMaskHooks` (separator id ``sep``) on ``model`` (a ``CausalLM``, after every
    other parallel transform: outermost) and on each block's ``layout().attention`` module; a
    context-parallel model (``model.cp_group``) masks inside its cp attention. Returns the hooks,
    whose ``documents(x)`` a runner wraps each micro-batch in. Raises ValueError if applied twice."""
    if isinstance(model.parallel_hooks, DocMaskHooks):
        raise ValueError("model already has document masking")
    hooks = DocMaskHooks(model.parallel_hooks, sep, getattr(model, "cp_group", None),
                         getattr(model.parallel_hooks, "impl", "ring"))
    model.parallel_hooks = hooks
    lay = model.layout()
    for block in get_module(model, lay.blocks):
        get_module(block, lay.attention).parallel_hooks = hooks
    return hooks
