"""What a generation request is, without torch: :class:`SamplingParams`, :class:`Request`,
:func:`is_eos`. The HTTP front end of ``zerotron serve`` (its own process by default,
:mod:`zerotron.serve.frontend`) builds and pickles these for the engine; keeping them torch-free
spares that process torch's import (~1.5-3 CPU s per server start on this machine). The engine's
modules import them from here (:mod:`~zerotron.inference.batch` and
:mod:`~zerotron.inference.sampling` re-export them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams", "Request", "is_eos"]


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


@dataclass
class Request:
    """One generation request: ``prompt`` token ids (non-empty), its :class:`SamplingParams`."""

    prompt: list[int]
    params: SamplingParams


def is_eos(token: int, eos) -> bool:
    """True if ``token`` ends a row: ``eos`` is one end id, a collection of them (a checkpoint
    may have several, e.g. Llama 3's ``<|end_of_text|>`` and ``<|eot_id|>``), or None (never)."""
    if eos is None:
        return False
    if isinstance(eos, int):
        return token == eos
    return token in eos
