"""One batch of requests being decoded together: :class:`Request`, :class:`DecodeBatch`.

A row stops at eos, at its max_tokens, or (with ``stop`` strings and a ``decode`` function) at
the first token after which its decoded new text contains a stop string: generation ends there,
every rank deciding alike from the same tokens (no message needed).

Prompts of different lengths share a batch by **left padding**: row b of a batch whose longest
prompt has L tokens gets ``L - len(prompt_b)`` padding slots in front, recorded in
``KVCache.pad``; every row then has its new token in the same (last) slot, positions are per row
(``slot - pad[b]``; learned positions and RoPE alike) and attention masks the padding keys, so a
row computes what it would alone (KV-cached decoding of one request).

Every row is fed one token per step until the whole batch is finished, so all rows of a batch
share one cache length. A finished row is either dropped from the batch and its cache
(:meth:`DecodeBatch.compact`, single process / tp / dp) or, in a pipeline, fed its last token
again with its output ignored (the stages would have to agree on every drop).

Context longer than ``block_size`` is handled as ``CausalLM.generate`` does: when the next token
would not fit, the cache is dropped and rebuilt from the last ``block_size`` tokens of every row
(positions restart at 0); from then on each step is a full forward of the cropped window. A row
shorter than the window then recomputes its whole (uncropped) sequence, which equals continuing
its cache up to rounding.
"""
from __future__ import annotations

import torch

from .kvcache import StaticKVCache
from .request import Request, is_eos
from .sampling import make_generator, sample_rows

__all__ = ["Request", "DecodeBatch", "PAD_ID"]

PAD_ID = 0  # token id in padding slots (masked out: any valid id would do)


class DecodeBatch:
    """Decoding state of requests ``requests`` (indices ``index`` in the caller's list): their token
    lists, done flags, generators (``params.seed`` each) and the KV cache of the layers this rank
    holds. ``eos_id``: end token id, or a tuple of them (see :func:`is_eos`; None: never stop early). ``block_size``: the model's
    context. ``decode``: token ids -> text, for requests with ``params.stop`` strings (a row ends at
    the token after which its decoded new text contains one). ``on_token(i, token)``: called for
    every token appended to request ``index[b]`` = i, as it is appended (streaming). Raises
    ValueError for an empty prompt, or stop strings without ``decode``."""

    def __init__(self, requests: list[Request], index: list[int], n_layer: int, block_size: int,
                 eos_id: int | tuple | None, device: torch.device, decode=None, on_token=None):
        for i, r in zip(index, requests):
            if not r.prompt:
                raise ValueError(f"request {i} has an empty prompt; every prompt needs at least one token")
            if r.params.stop and decode is None:
                raise ValueError(f"request {i} has stop strings but the engine has no decode function (tokenizer)")
        self.decode, self.on_token = decode, on_token
        self.requests, self.index, self.n_layer = requests, list(index), n_layer
        self.block_size, self.eos_id, self.device = block_size, eos_id, device
        self.tokens = [list(r.prompt) for r in requests]
        self.new = [[] for _ in requests]
        self.done = [r.params.max_tokens == 0 for r in requests]
        self.generators = [make_generator(r.params.seed, device) for r in requests]
        self.cache: StaticKVCache | None = None
        self.steps = 0
        self.active = list(range(len(requests)))  # rows in the cache, in cache order

    @property
    def finished(self) -> bool:
        """True when every row has reached eos or its max_tokens."""
        return all(self.done)

    @property
    def size(self) -> int:
        return len(self.requests)

    def next_input(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens of the next forward and whether the cache is (re)built: ``(idx, pad)`` with
        idx (b, T) int64 and ``pad`` (b,) int64 for a (re)prefill (the caller then calls
        :meth:`start` with ``pad`` and T), or ``(last tokens (b, 1), None)`` to continue the cache."""
        slots = 0 if self.cache is None else self.cache.cached(self._first_layer())
        if self.cache is not None and slots + 1 <= self.block_size:
            return torch.tensor([[self.tokens[b][-1]] for b in self.active], device=self.device), None
        rows = [self.tokens[b][-self.block_size:] for b in self.active]
        L = max(len(r) for r in rows)
        idx = torch.tensor([[PAD_ID] * (L - len(r)) + r for r in rows], device=self.device)
        pad = torch.tensor([L - len(r) for r in rows], device=self.device)
        return idx, pad

    def _first_layer(self) -> int:
        return next(i for i, k in enumerate(self.cache.keys) if k is not None)

    def start(self, pad: torch.Tensor | None, length: int = 0) -> StaticKVCache:
        """The cache of the next forward: for a (re)prefill (``pad`` given) of ``length`` slots a new
        :class:`StaticKVCache` with room for the most new tokens any active row still needs
        (capped at block_size), else the current one."""
        if pad is not None:
            more = max((self.requests[b].params.max_tokens - len(self.new[b]) for b in self.active), default=0)
            self.cache = StaticKVCache(self.n_layer, pad, max(1, min(self.block_size, length + more)))
        return self.cache

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Next tokens (b,) int64 from the last-position logits (b, V) of the active rows."""
        return sample_rows(logits, [self.requests[b].params for b in self.active],
                           [self.generators[b] for b in self.active])

    def compact(self) -> None:
        """Drop the finished rows from the batch and from every cached layer (and ``pad``)."""
        keep = [i for i, b in enumerate(self.active) if not self.done[b]]
        if len(keep) == len(self.active) or not keep or self.cache is None:
            return
        self.cache.keep_rows(torch.tensor(keep, device=self.device))
        self.active = [self.active[i] for i in keep]

    def advance(self, next_tokens: torch.Tensor | list[int]) -> None:
        """Append each unfinished active row's token (one per active row, in cache order); mark rows
        done at eos or max_tokens."""
        self.steps += 1
        toks = next_tokens.tolist() if torch.is_tensor(next_tokens) else next_tokens
        for b, t in zip(self.active, toks):
            if self.done[b]:
                continue
            self.tokens[b].append(t)
            self.new[b].append(t)
            if self.on_token is not None:
                self.on_token(self.index[b], t)
            p = self.requests[b].params
            if len(self.new[b]) >= p.max_tokens or (p.stop_at_eos and is_eos(t, self.eos_id)) or \
                    (p.stop and self._hit_stop(b, p.stop)):
                self.done[b] = True

    def _hit_stop(self, b: int, stops: tuple[str, ...]) -> bool:
        text = self.decode(self.new[b])
        return any(s in text for s in stops)

    def kv_bytes(self) -> int:
        """Storage bytes of the keys and values this rank caches for the batch."""
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.cache.keys + self.cache.values if t is not None)
