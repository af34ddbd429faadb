"""The interface every parallel strategy offers the trainer, with the non-pipelined defaults.

A strategy owns this rank's part of the model and knows how to run one optimizer step's
forward/backward over its micro-batches, synchronise gradients, clip, and step the optimizer.

Loss normalisation (world-size invariance): each micro-batch contributes
    (sum of its token cross-entropies) / N_global
where N_global is the number of valid targets in the *whole global batch*; gradients are SUMMED over
data-parallel ranks. The result equals the single-process mean over all valid tokens.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from zerotron.distributed import comm
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.optim import build_optimizer
from zerotron.parallel.precision import upcast
from zerotron.parallel.tensor.layers import full_tensor, is_tp_sharded, local_shard
from zerotron.parallel.tensor.transform import (
    load_dense_into_tp,
    sync_replicated_grads,
    tp_loss_sum,
    tp_state_dict_full,
)

IGNORE_INDEX = -100


def autocast_ctx(dtype: str, device: torch.device):
    """``torch.autocast`` to bfloat16 for ``dtype == "bf16"``, else a null context (fp32 / fp64:
    the parameters' dtype)."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over valid targets: logits (B, T, V), targets (B, T) int64 -> scalar in
    float32 (float64 for float64 logits)."""
    return F.cross_entropy(upcast(logits).reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def unique_params(module: torch.nn.Module) -> list:
    """Trainable parameters of ``module`` in registration order, each once (tied weights deduplicated)."""
    seen, out = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def post_accumulate_hooks(params, method) -> list:
    """``p.register_post_accumulate_grad_hook(method)`` for each of ``params``, with ``method`` (a
    bound method of a gradient sync) held weakly; returns the hook handles.

    torch keeps a tensor's post-accumulate hooks in a dict that its C++ side also references, where
    Python's garbage collector cannot see it: a hook bound to an object that holds the parameters
    (module, buckets, process groups) makes a cycle no collection frees, so every gradient sync built
    in a process would live (with its model, gradient buffers and gloo groups' threads) until the
    process ends. Through a weak reference the sync is freed as soon as nothing else holds it; its
    hooks then do nothing."""
    ref = weakref.WeakMethod(method)

    def hook(p, ref=ref):
        fn = ref()
        if fn is not None:
            fn(p)

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


class Strategy:
    """Base strategy: replicated model, plain micro-batch loop. Subclasses override what they change.

    Attributes: ``module`` (the plain model holding this rank's parameters), ``loss_groups`` (groups
    over which per-rank loss sums are all-reduced into the global loss sum)."""

    module: torch.nn.Module
    loss_groups: list = []
    tp_group = None  # comm.NamedGroup of the tp dimension when the module is tensor-parallel
    documents = None  # data.doc_mask: ``DocMaskHooks.documents`` (tokens -> context of one micro-batch)

    def doc_context(self, x: torch.Tensor):
        """The context every forward (and backward) of the micro-batch with tokens ``x`` runs in:
        its documents under ``data.doc_mask`` (``parallel.context.docmask``), else nothing."""
        return self.documents(x) if self.documents is not None else contextlib.nullcontext()

    def __init__(self, module: torch.nn.Module | None = None):
        """A bare strategy around a plain module (single process, no gradient sync)."""
        if module is not None:
            self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self) -> list:
        """Unique trainable parameters held by this rank."""
        return unique_params(self.module)

    def no_sync(self):
        return contextlib.nullcontext()

    def finish_grads(self) -> None:
        """Complete gradient reduction after the last backward of the step."""

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss of one micro-batch; vocab-parallel cross-entropy when the module is
        tensor-parallel (logits are then vocab shards, never gathered)."""
        if self.tp_group is not None:
            return tp_loss_sum(self.module, logits, targets)
        return token_loss_sum(logits, targets)

    def sync_tp_replicated(self) -> None:
        """Sequence parallel: sum over tp the gradients of tp-replicated parameters."""
        if self.tp_group is not None:
            sync_replicated_grads(self.module)

    def forward_backward(self, micro_batches, n_global: int, dtype: str, device: torch.device) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches ``[(x, y), ...]`` (each (b, T) int64),
        each loss divided by ``n_global``; gradient sync only on the last micro-batch.
        Returns this rank's loss sum (float64 scalar, CPU, not yet reduced)."""
        total = torch.zeros((), dtype=torch.float64)
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with self.no_sync() if i < last else contextlib.nullcontext(), self.doc_context(x):
                with autocast_ctx(dtype, device):
                    logits = self(x)
                loss = self.loss_sum(logits, y)
                del logits  # autograd keeps what it needs; held, the logits would outlive the backward
                (loss / n_global).backward()
            total += loss.detach().double().cpu()
        return total

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor, dtype: str, device: torch.device):
        """Forward only: ``(loss_sum, valid_token_count)`` of one batch as float64 CPU scalars.
        Both are summed over ``loss_groups`` by the caller (pipeline stages other than the last
        return zeros)."""
        x, y = x.to(device), y.to(device)
        with autocast_ctx(dtype, device), self.doc_context(x):
            logits = self(x)
        return (self.loss_sum(logits, y).double().cpu(),
                torch.tensor(float((y != IGNORE_INDEX).sum()), dtype=torch.float64))

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 gradient norm (before clipping), clipping in place when ``max_norm > 0``
        (:func:`zerotron.parallel.grad_norm.clip_grad_norm`). Default (gradients replicated over dp
        after the reduction): tensor-parallel shards summed over tp, tp-replicated ones counted
        once; identical on every rank."""
        grads = [(q.grad, is_tp_sharded(q)) for q in self.parameters() if q.grad is not None]
        return clip_grad_norm([([g for g, s in grads if s], [self.tp_group]),
                               ([g for g, s in grads if not s], [])], max_norm)

    def build_optimizer(self, tcfg, mask: dict):
        """AdamW over this rank's parameters (see ``train.optim.build_optimizer``)."""
        return build_optimizer(self.parameters(), mask, tcfg)

    def optimizer_step(self, optimizer) -> None:
        optimizer.step()

    def model_state_bytes(self, optimizer) -> dict:
        """Bytes this rank holds for parameters (frozen ones too), gradients and optimizer state
        (storage sizes; of the local shard for DTensors, as FSDP2 and DTensor TP hold them);
        gradients and optimizer state exist for trainable parameters only (LoRA: the adapters)."""
        def nbytes(t):
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()
        params = self.parameters()
        p_bytes = sum(nbytes(p) for p in {id(q): q for q in self.module.parameters()}.values())
        g_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
        o_bytes = sum(nbytes(t) for s in optimizer.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"params_bytes": p_bytes, "grads_bytes": g_bytes, "optimizer_bytes": o_bytes,
                "total_bytes": p_bytes + g_bytes + o_bytes}

    def full_params(self):
        """Context in which ``self.module`` holds every parameter in full (evaluation, generation,
        export); a no-op for replicated strategies."""
        return contextlib.nullcontext(self.module)

    def state_dict(self, optimizer=None):
        """``(model_state, optimizer_state)`` in the canonical layout-independent format: FQN-keyed
        full tensors as produced by ``torch.distributed.checkpoint.state_dict.get_state_dict`` for
        the plain model (optimizer state ``{"state": {fqn: {...}}, "param_groups": [...]}``)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.tp_group is not None:
            return self._tp_state_dict(optimizer)
        if optimizer is None:
            return get_state_dict(self.module, [])[0], None
        return get_state_dict(self.module, optimizer)

    def _tp_state_dict(self, optimizer):
        """Tensor parallel: gather every shard to its dense tensor (collective over tp)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        msd = tp_state_dict_full(self.module)
        if optimizer is None:
            return msd, None
        osd = get_optimizer_state_dict(self.module, optimizer)  # references the live state: copy
        params = dict(self.module.named_parameters())
        state = {fqn: {k: full_tensor(params[fqn], self.tp_group, local=v)
                       if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in st.items()}
                 for fqn, st in osd["state"].items()}
        return msd, {**osd, "state": state}

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical state (from :meth:`state_dict` of any layout) into this rank."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict

        if self.tp_group is not None:
            load_dense_into_tp(self.module, msd)
            if optimizer is not None:
                params = dict(self.module.named_parameters())
                state = {fqn: {k: local_shard(params[fqn], v, self.tp_group) for k, v in st.items()}
                         for fqn, st in osd["state"].items()}
                set_optimizer_state_dict(self.module, optimizer, {**osd, "state": state})
            return
        if optimizer is None:
            self.module.load_state_dict(msd)
        else:
            set_state_dict(self.module, optimizer, model_state_dict=msd, optim_state_dict=osd)

    def checkpoint_state(self, optimizer=None):
        """``(model_state, optimizer_state)`` this rank hands to torch.distributed.checkpoint: the
        canonical :meth:`state_dict`, or (sharded strategies) the part of it this rank owns --
        DCP writes each key once, so the files are the same. Collective."""
        return self.state_dict(optimizer)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load what DCP filled into :meth:`checkpoint_state`'s dicts. Collective."""
        self.load_state_dict(msd, osd, optimizer)

    def reduce_loss(self, loss_sum: torch.Tensor) -> float:
        """Global loss sum: this rank's sum all-reduced over ``loss_groups``."""
        t = loss_sum.clone()
        for g in self.loss_groups:
            comm.all_reduce(t, group=g, tag="metrics")
        return float(t)
