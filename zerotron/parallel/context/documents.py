"""Document indices and document-masked attention, the pure functions of ``data.doc_mask`` (the
conventions are in :mod:`.docmask`): token ids -> (document index, position in document), the
boolean same-document-and-causal mask, and dense masked attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zerotron.models import attn_dropout

__all__ = ["allowed_mask", "doc_attention", "document_ids"]


def document_ids(x: torch.Tensor, sep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc, pos)`` of tokens ``x`` (B, T) int64 with separator id ``sep``: doc (B, T) int64, the
    document index of each token within its row (0, 1, ...; a separator belongs to the document it
    ends), and pos (B, T) int64, its position within that document (0 at each document's first
    token)."""
    is_sep = (x == sep).long()
    doc = torch.cumsum(is_sep, dim=1) - is_sep
    t = torch.arange(x.size(1), device=x.device).expand_as(x)
    start = torch.ones_like(is_sep, dtype=torch.bool)
    start[:, 1:] = is_sep[:, :-1].bool()
    first = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values
    return doc, t - first


def allowed_mask(qdoc: torch.Tensor, kdoc: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, Tq, Tk): query i may see key j iff they are in the same document
    (``qdoc`` (B, Tq), ``kdoc`` (B, Tk)) and j is not in i's future (global sequence indices
    ``qpos`` (Tq,), ``kpos`` (Tk,))."""
    same = qdoc[:, :, None] == kdoc[:, None, :]
    return (same & (kpos[None, :] <= qpos[:, None])[None])[:, None]


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor,
                  dropout_p: float = 0.0, drop: attn_dropout.AttnDropout | None = None) -> torch.Tensor:
    """Document-masked causal attention over a whole sequence: q (B, H, T, D), k/v (B, H_kv, T, D)
    (H a multiple of H_kv), ``doc`` (B, T) document indices -> (B, H, T, D); SDPA with the boolean
    mask of :func:`allowed_mask` (every row sees at least itself). ``dropout_p`` > 0: torch's fused
    dropout, or the coordinate mask (``models.attn_dropout``) when forced or when ``drop`` (an
    ``AttnDropout``: the key and this tensor's first row and head) is given."""
    t = torch.arange(q.size(2), device=q.device)
    if drop is None and dropout_p > 0 and attn_dropout.forced():
        drop = attn_dropout.AttnDropout(dropout_p, attn_dropout.draw_key())
    if drop is not None:
        return attn_dropout.coordinate_attention(q, k, v, allowed_mask(doc, doc, t, t), drop, t, t)
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(doc, doc, t, t), dropout_p=dropout_p)
