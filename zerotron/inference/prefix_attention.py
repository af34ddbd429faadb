"""Shared-prefix attention for the paged engine: rows that start with the same KV blocks (a shared
system prompt found through the prefix cache, the ``n > 1`` forks of one prompt) attend to those
blocks' keys and values *once*, not once per row.

A paged forward gathers every row's keys and values through its block table into a left-padded
(B, H_kv, S, D) tensor (:class:`~zerotron.inference.paged.PagedView`); with B rows behind one P-token
system prompt that copies and reads the prompt's keys B times per layer. Cascade attention
(Juravsky et al. 2024, "Hydragen: High-Throughput LLM Inference with Shared Prefixes"; FlashInfer's
cascade inference) splits each query's attention into the shared prefix and the row's own suffix:

* prefix: all B·T queries of a kv head against the prefix's P keys in one matrix product (the keys
  read once, an (H_kv, B·rep·T, D) x (H_kv, D, P) GEMM instead of B GEMVs), no mask (every query of
  the forward comes after the whole prefix);
* suffix: each row's own keys (the usual left-padded gather, causal and padding masks);

each with the log-sum-exp of its scaled scores, merged by the log-sum-exp rule
(:func:`zerotron.parallel.context.ring.merge`, the rule ring attention uses for its blocks), which
is softmax attention over the union exactly (up to rounding).

:func:`shared_prefix_hooks` installs, for one forward, a :class:`SharedPrefixHooks` on the
attention module of each given block (the model layout's ``attention`` path, as context
parallelism installs its hooks), reading the prefix keys the view gathered for the current layer;
a view without a shared prefix leaves attention to the hooks that were there.
"""
from __future__ import annotations

import contextlib
import math

import torch

from zerotron.models.base import WrappingHooks
from zerotron.models.layout import get_module
from zerotron.parallel.context.ring import merge

__all__ = ["SharedPrefixHooks", "attention_modules", "shared_prefix_hooks", "prefix_attention", "suffix_attention",
           "suffix_bias"]


def _fused(q: torch.Tensor):
    """torch's fused attention kernel returning the log-sum-exp on q's device, or None."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return op if q.device.type == "cpu" and op is not None else None


def prefix_attention(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query against a shared prefix, unmasked: q (B, H, T, D), kp/vp (H_kv, P, D) with H a
    multiple of H_kv (query head h reads kv head h // (H / H_kv)) -> (output (B, H, T, D), log-sum-exp
    of the scaled scores (B, H, T)); scores scaled by 1/sqrt(D)."""
    B, H, T, D = q.shape
    hkv = kp.size(0)
    rep = H // hkv
    # (H_kv, B * rep * T, D): the queries of each kv head in one matrix against its P keys
    qh = q.reshape(B, hkv, rep * T, D).transpose(0, 1).reshape(1, hkv, B * rep * T, D)
    fused = _fused(q)
    if fused is not None:
        out, lse = fused(qh, kp[None], vp[None], 0.0, False)
    else:
        s = torch.matmul(qh, kp[None].transpose(-1, -2)) / math.sqrt(D)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse[..., None]), vp[None])
    out = out.reshape(hkv, B, rep * T, D).transpose(0, 1).reshape(B, H, T, D)
    return out, lse.reshape(hkv, B, rep * T).transpose(0, 1).reshape(B, H, T)


def suffix_bias(pad: torch.Tensor, T: int, S: int, dtype) -> torch.Tensor:
    """The additive mask (B, 1, T, S) (0 where allowed, -inf elsewhere) of the T newest queries over
    each row's own S keys, left padding masked as :func:`zerotron.models.base.causal_attention`
    masks it: query i (slot S - T + i) sees keys pad[b] .. S - T + i, and a padding query itself."""
    qpos = torch.arange(S - T, S, device=pad.device)[:, None]  # (T, 1) slots of the queries
    kpos = torch.arange(S, device=pad.device)[None, :]  # (1, S)
    allowed = ((kpos <= qpos)[None] & (kpos[None] >= pad[:, None, None])) | (kpos == qpos)[None]  # (B, T, S)
    return torch.zeros(allowed.shape, dtype=dtype, device=pad.device).masked_fill_(~allowed, float("-inf"))[:, None]


def suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the T newest queries over each row's own S keys with left padding
    (:func:`suffix_bias`, or ``bias`` when computed already): q (B, H, T, D), k/v (B, H_kv, S, D)
    (any strides but the last), pad (B,) -> (output (B, H, T, D), log-sum-exp (B, H, T))."""
    B, H, T, D = q.shape
    hkv, S = k.size(1), k.size(2)
    bias = suffix_bias(pad, T, S, q.dtype) if bias is None else bias
    fused = _fused(q)
    if fused is not None:  # grouped-query heads read in place, k/v strides as they come
        out, lse = fused(q, k, v, 0.0, False, attn_mask=bias)
        return out, lse
    rep = H // hkv
    s = torch.matmul(q.reshape(B, hkv, rep * T, D), k.transpose(-1, -2)) / math.sqrt(D)  # (B, H_kv, rep * T, S)
    s = s.view(B, hkv, rep, T, S) + bias[:, :, None]
    lse = torch.logsumexp(s, dim=-1)  # finite: every query sees at least itself
    out = torch.matmul(torch.exp_(s.sub_(lse[..., None])).view(B, hkv, rep * T, S), v)
    return out.view(B, H, T, D), lse.view(B, H, T)


class SharedPrefixHooks(WrappingHooks):
    """Attention hooks layered over ``inner`` for one paged forward (``view``: its
    :class:`~zerotron.inference.paged.PagedView`): when the view split off a shared prefix, the
    keys and values the model passes are each row's suffix, and :meth:`attention` adds the prefix
    the view gathered for this layer (``view.prefix``: (H_kv, P, D) keys and values) by the
    log-sum-exp merge; otherwise ``inner`` attends as before. Raises ValueError for attention
    dropout with a shared prefix (decoding runs in eval mode)."""

    def __init__(self, inner, view):
        super().__init__(inner)
        self.view = view

    def attention(self, q, k, v, dropout_p: float, pad=None):
        pre = self.view.prefix
        if pre is None:
            return self.inner.attention(q, k, v, dropout_p, pad)
        if dropout_p > 0:
            raise ValueError("shared-prefix attention runs without attention dropout (decode in eval mode)")
        key = ("suffix_bias", q.dtype, q.size(2), k.size(2))  # the same for every layer of the forward
        bias = self.view.memo.get(key)
        if bias is None:
            bias = self.view.memo[key] = suffix_bias(pad, q.size(2), k.size(2), q.dtype)
        out, _ = merge(*prefix_attention(q, *pre), *suffix_attention(q, k, v, pad, bias))
        return out.to(q.dtype)


def attention_modules(model, blocks, layers) -> list:
    """The attention module (``model.layout().attention``) of ``blocks[i]`` for i in ``layers``."""
    path = model.layout().attention
    return [get_module(blocks[i], path) for i in layers]


@contextlib.contextmanager
def shared_prefix_hooks(modules, view):
    """For the ``with`` block: a :class:`SharedPrefixHooks` over ``view`` on each attention module of
    ``modules`` (:func:`attention_modules`); the hooks that were there are put back after. Does
    nothing when ``view`` split off no shared prefix."""
    if not view.prefix_blocks:
        yield
        return
    old = [m.parallel_hooks for m in modules]
    try:
        for m, h in zip(modules, old):
            m.parallel_hooks = SharedPrefixHooks(h, view)
        yield
    finally:
        for m, h in zip(modules, old):
            m.parallel_hooks = h
