"""Activation checkpointing (recomputation) as a transform: ``train.activation_checkpointing``.

* ``"full"``: each transformer block keeps only its input; its whole forward is recomputed during
  backward (Chen et al. 2016; Korthikanti et al. 2022 "full recomputation").
* ``"selective"``: each block's attention sub-layer (QKV projection, attention, output projection)
  is recomputed; the MLP keeps its activations. Korthikanti et al.'s selective recomputation
  re-runs only the core attention (QK^T, softmax, dropout, AV); recomputing the projections too
  costs a little more compute and saves a little more memory, and needs no hook inside the model.
* ``"none"``: nothing is recomputed.

Implemented with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` by overriding the
``forward`` of the block (or attention) *instance*, so parameter names, state dicts and
checkpoints are unchanged. Dropout masks are reproduced by checkpoint's RNG-state preservation
(kept only for a module with dropout: :func:`_draws_random`).
Generation (a KV cache) and evaluation (no grad) run the plain forward.

Parameter sharding. The recompute calls the block's inner forward, not the module, so no forward
hook fires on it; it runs when backward first needs the block's saved activations, which is after
the gradient has passed the block's output. Native ZeRO-3 (``parallel.data.zero_gather``) marks
that output with a pre-backward identity that all-gathers the block's parameters, so the recompute
and the backward find them gathered, and the gradient hooks free them once the block's gradients
are reduced: a block's full parameters exist only around its forward and its recompute+backward
(Rajbhandari et al. 2020, sec. 5.3). FSDP2 (torch ``fully_shard``) unshards a block before its
backward in the same way (Zhao et al. 2023); a pipeline's ZeRO-3 is the same driver (``data.zero.ZeroSync``).

Autocast's weight casts. ``torch.autocast`` caches the bf16 cast of every fp32 leaf parameter it
casts (``aten/src/ATen/autocast_mode.cpp``: ``cached_casts``, keyed by the weight, held until the
outermost autocast region exits), so one forward over fp32 parameters (DDP, tensor parallel
without ZeRO) holds the casts of *every* block until the head is done. Without recomputation the
Linears save those casts for their backward anyway; a recomputed region saves nothing, so the cache
was their only holder: Llama-3-70B at tp 8 kept 17 GB of block casts per rank through the forward
(issue 33's dry run, 1.096 x the estimate). A forward hook on each recomputed module therefore
clears the cache after it (``torch.clear_autocast_cache``, thread-local: the stage threads of
``pp_impl = threads`` clear their own); the recompute in backward casts again inside its own
autocast region, which clears on exit. Outside autocast the cache is empty and the call a no-op.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from zerotron.models.layout import get_module

MODES = ("none", "selective", "full")


def _draws_random(module) -> bool:
    """Whether ``module``'s training forward can draw random numbers: a submodule with a dropout
    probability > 0 (``p`` of ``nn.Dropout`` and of tensor parallelism's ``TrackedDropout``, or a
    float ``dropout`` attribute: the attention-probability dropout of ``models/``)."""
    for m in module.modules():
        for p in (getattr(m, "p", None), getattr(m, "dropout", None)):
            if isinstance(p, float) and p > 0:
                return True
    return False


def _recompute(module, forward):
    """``forward`` of ``module`` recomputed in backward. checkpoint saves the generator states
    (the CPU one: 5,056 bytes, not made by any operator, so a dry run's tracker cannot see it; and
    each device's) for every call only when the recomputation needs them, i.e. the module has
    dropout (``preserve_rng_state``; issue 33: the real run held up to m x n_layer such states more
    than the dry run traced)."""
    keep_rng = _draws_random(module)  # once, at wrap time: not a module walk per forward

    def wrapped(x, kv_cache=None):
        if kv_cache is not None or not torch.is_grad_enabled():
            return forward(x, kv_cache)
        return checkpoint(forward, x, use_reentrant=False, preserve_rng_state=keep_rng)
    return wrapped


def _drop_autocast_casts(module, inputs, output) -> None:
    """Forward hook of a recomputed module: drop autocast's cached weight casts (module docstring)."""
    torch.clear_autocast_cache()


def apply_activation_checkpointing(model, mode: str):
    """Make every block of ``model`` (``model.layout().blocks``; with "selective" the block's
    ``layout().attention`` submodule) recompute its activations in backward, and drop autocast's
    weight casts after each such module's forward (module docstring; a hook on the module, so
    ``train.compile``'s compiled forward never traces it).

    Returns ``model`` (modified in place). Raises ValueError for an unknown ``mode``."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model
    lay = model.layout()
    for block in get_module(model, lay.blocks):
        target = block if mode == "full" else get_module(block, lay.attention)
        target.forward = _recompute(target, target.forward)
        target.register_forward_hook(_drop_autocast_casts)
    return model
