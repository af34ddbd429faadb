"""Speculative decoding without a draft model: :func:`ngram_propose` (prompt lookup) and
:func:`accept_drafts` (the verification rule).

A cheap proposer guesses the next k tokens; the target model scores the row's last token and the k
guesses in one forward (k + 1 positions), and the guesses are accepted left to right as long as
the target agrees, plus one token of the target's own (Leviathan, Kalman & Matias, ICML 2023;
Chen et al., 2023). Greedy rows accept a guess when it is the target's argmax, so the output is
exactly the one of plain greedy decoding; sampled rows use rejection sampling, which keeps the
target's distribution whatever the guesses are.

The proposer is prompt lookup (n-gram matching, Saxena 2023; vLLM's ``ngram`` speculator): find the
most recent earlier occurrence of the row's last n tokens (n = max_n .. 1) and propose the tokens
that followed it. It pays off on repetitive text (code, quoting the prompt, lists)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .sampling import SamplingParams, filter_logits

__all__ = ["ngram_propose", "accept_drafts"]


def ngram_propose(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    """Up to ``k`` proposed next tokens of the sequence ``tokens``: those that followed the most
    recent earlier occurrence of its last n tokens that has k tokens after it (else the occurrence
    with the most), for the largest n <= ``max_n`` that occurs before; [] if none (or k < 1)."""
    L = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, L - 1), 0, -1):
        tail, best = tokens[L - n:], []
        for j in range(L - n - 1, -1, -1):  # start of an earlier occurrence (not the suffix itself)
            if tokens[j:j + n] == tail:
                follow = tokens[j + n:j + n + k]
                if len(follow) > len(best):
                    best = follow
                if len(best) == k:
                    break
        if best:
            return best
    return []


def accept_drafts(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                  generator: torch.Generator | None) -> list[int]:
    """Verify ``drafts`` (n tokens) against the target's logits (n + 1, V) at the positions of
    the row's last token and each draft: the accepted drafts followed by one token of the target
    (1 .. n + 1 tokens). Greedy (temperature 0): a draft is accepted while it equals the argmax,
    the target's argmax follows. Sampled: draft d at position i (a point-mass proposal) is
    accepted with probability p_i(d) (one uniform draw of ``generator``); at the first rejection
    the token is drawn from p_i with d removed and renormalised; after n acceptances from p_n:
    each emitted token is distributed as the target's p (Leviathan et al. 2023, Theorem 1).
    p_i: softmax of the filtered logits (temperature, top-k, top-p), in float64."""
    out: list[int] = []
    if params.temperature == 0:
        best = logits.argmax(dim=-1).tolist()
        for i, d in enumerate(drafts):
            out.append(best[i])
            if best[i] != d:
                return out
        return out + [best[len(drafts)]]
    for i, d in enumerate(drafts):
        probs = F.softmax(filter_logits(logits[i].double(), params.temperature, params.top_k, params.top_p), dim=-1)
        u = torch.rand((), dtype=torch.float64, generator=generator, device=logits.device)
        if u < probs[d]:
            out.append(d)
            continue
        rest = probs.clone()
        rest[d] = 0
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=generator)[0]))
        return out
    probs = F.softmax(filter_logits(logits[len(drafts)].double(), params.temperature, params.top_k, params.top_p),
                      dim=-1)
    return out + [int(torch.multinomial(probs, 1, generator=generator)[0])]
