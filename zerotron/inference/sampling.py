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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["SamplingParams", "make_generator", "sample_rows"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``max_tokens``: new tokens at most (>= 0); ``temperature``: 0 =
    greedy argmax, else logits / temperature; ``top_k``: keep the k largest (None = all);
    ``top_p``: nucleus mass in (0, 1] (1 = all); ``seed``: the request generator's seed;
    ``stop_at_eos``: end the request when it emits the end-of-text token; ``stop``: strings that
    end the request as soon as its decoded new text contains one (checked after every token, so
    decoding stops there; the engine needs a ``decode`` function for them)."""

    max_tokens: int = 100
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True
    stop: tuple[str, ...] = ()

    def validate(self) -> "SamplingParams":
        """Return self; raise ValueError (one line naming the field) for max_tokens < 0, a
        temperature that is not a finite number >= 0, top_k < 1, top_p outside (0, 1] or a stop
        that is not a tuple of non-empty strings."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (math.isfinite(self.temperature)
                                                                  and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        return self


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
