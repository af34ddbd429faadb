"""Per-request sampling: :class:`SamplingParams`, one ``torch.Generator`` per request, and
:func:`sample_rows`, which turns a batch of logits into one next token per row.

Each row is sampled with its own parameters and its own generator (seeded ``seed + request
index`` by the caller), one draw per decoding step, so a request's tokens depend only on its
prompt, its parameters and its seed: not on the batch it shares, its row, the micro-batch split
or the parallel layout. Filtering order as in HF transformers: temperature, then top-k, then
top-p (nucleus, Holtzman et al. 2020: the smallest set of most likely tokens whose probability
reaches p; the most likely token is always kept).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .request import SamplingParams  # torch-free (the HTTP front end imports it)

__all__ = ["SamplingParams", "make_generator", "sample_rows"]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(int(seed))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """One row of logits (V,) float -> scaled logits with the filtered-out tokens at -inf.

    A temperature so small that ``logits / temperature`` overflows (1e-320 is a finite number > 0)
    is applied to ``logits - max(logits)`` instead: the same softmax (it is shift invariant), with
    the largest logit at 0 instead of +inf, whose softmax would be NaN."""
    scaled = logits / temperature
    if not torch.isfinite(scaled).all():
        scaled = (logits - logits.max()) / temperature
    logits = scaled
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token already >= p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """Next tokens (B,) int64 for logits (B, V) (any float dtype; sampled in float64 so that near-ties
    are resolved identically whatever the dtype of the model was), row b with ``params[b]`` and
    ``generators[b]``: argmax when temperature is 0, else one ``torch.multinomial`` draw."""
    out = logits.argmax(dim=-1)  # greedy rows (argmax is exact in any dtype)
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            row = logits[b].double()
            probs = F.softmax(filter_logits(row, p.temperature, p.top_k, p.top_p), dim=-1)
            out[b] = torch.multinomial(probs, 1, generator=g)[0]
    return out
