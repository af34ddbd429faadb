"""Data parallelism: bucketed gradient all-reduce overlapped with backward.

Native implementation (``parallel.dp_impl = "native"``):
  * parameters are grouped into buckets of ~``bucket_mb`` MiB in *reverse registration order*
    (roughly the order backward produces their gradients, as in PyTorch DDP, Li et al. 2020);
  * each bucket owns one flat gradient buffer and every ``param.grad`` is a view into it
    (no copies: autograd accumulates straight into the buffer);
  * a post-accumulate-grad hook counts ready parameters; as soon as a bucket is complete its
    all-reduce is launched asynchronously, so communication overlaps the rest of backward.
    Buckets are launched strictly in index order so every rank issues collectives in the same order;
  * inside ``no_sync()`` (non-final micro-batches of an accumulation window) nothing is
    communicated: gradients just accumulate in the buffers;
  * ``finish_grads()`` launches any bucket whose parameters got no gradient in this step (their
    gradient is zero on this rank; all ranks still take part, so replicas never diverge) and waits.
  * unused parameters: hooks mark each parameter that received a gradient in this step (any
    micro-batch); the marks are summed over dp in one small all-reduce per step (one float per
    parameter, overlapping the bucket reductions), and a parameter no dp rank used gets
    ``grad = None`` -- torch's optimizer then skips it (no decay, no moment update, no step),
    exactly as on one process. A parameter used on any rank keeps its (summed) gradient.

Reduction is a SUM: the trainer divides the loss by the number of target tokens of the *whole global
batch*, so summing per-rank gradients gives exactly the single-process gradient (no 1/world_size).

``parallel.dp_impl = "torch"`` wraps ``torch.nn.parallel.DistributedDataParallel`` with a SUM comm
hook (routed through ``comm.all_reduce`` so its traffic is counted too), for comparison. A parameter
without gradient needs ``parallel.find_unused_parameters = true`` there (torch then leaves its grad
None, as on one process); without it torch DDP never completes that bucket and replicas silently
diverge, so :class:`TorchDDP` refuses the step with a one-line ConfigError naming the parameter.
What counts is the *final, synchronised* backward of the accumulation window: torch DDP reduces only
in that one, so a parameter that got its gradient in an earlier (``no_sync``) micro-batch only is
just as unreduced although its ``grad`` is not None. Post-accumulate-grad hooks record the
parameters reached while DDP syncs (a set insert each), and the check reads those marks.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerotron.config import ConfigError
from zerotron.distributed import comm
from zerotron.parallel.base import Strategy, post_accumulate_hooks, unique_params
from zerotron.parallel.data.hsdp import HierarchicalAllReduce, hierarchical_finish, progress
from zerotron.parallel.data.used import UsedMarks


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device, dtype, pad_to: int = 1):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # padded to a multiple of the shard group (hierarchical all-reduce); the tail stays zero
        self.buffer = torch.zeros(-(-self.numel // pad_to) * pad_to, device=device, dtype=dtype)
        self.hier = None
        self.ready: set[int] = set()
        self.work = None
        off = 0
        for p in params:
            p.grad = self.buffer[off:off + p.numel()].view_as(p)
            off += p.numel()


class DataParallel(Strategy):
    """Native bucketed DDP over the ``dp`` group.

    Args:
        module: the model (replicated on every dp rank).
        group: ``comm.NamedGroup`` of the dp dimension.
        bucket_mb: bucket capacity in MiB (a parameter larger than that gets a bucket of its own).
        src_rank: global rank whose parameters are broadcast to the others at start.
        shard_group, replicate_group: HSDP (``parallel.dp_replicate > 1``): each bucket is summed by
            a hierarchical all-reduce (``parallel.data.hsdp.HierarchicalAllReduce``: reduce-scatter
            within ``shard_group``, all-reduce across ``replicate_group``, all-gather within), the
            reduce-scatter launched from the hooks, each next collective as the previous completes
            (during backward, in bucket order), the rest in :meth:`finish_grads`.
        exclude: ids of parameters this DDP neither broadcasts nor reduces (expert parallelism
            reduces the expert-local ones over its own group, ``parallel.expert``).
    Attributes: ``module``, ``buckets``.
    Raises ValueError if the module has no trainable parameters."""

    def __init__(self, module: nn.Module, group: comm.NamedGroup, bucket_mb: float = 25.0, src_rank: int = 0,
                 shard_group=None, replicate_group=None, exclude=frozenset()):
        self.module, self.group, self.loss_groups = module, group, [group]
        self.hierarchical = replicate_group is not None
        pad = shard_group.size() if self.hierarchical else 1
        params = [p for p in unique_params(module) if id(p) not in exclude]
        if not params:
            raise ValueError("DataParallel: the module has no trainable parameters")
        with torch.no_grad():  # identical start on all replicas (init is already seeded; this enforces it)
            comm.broadcast_coalesced([p.data for p in params], src=src_rank, group=group, tag="init")
        cap = int(bucket_mb * 2**20)
        self.buckets: list[_Bucket] = []
        current, size = [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                self.buckets.append(_Bucket(current, p.device, p.dtype, pad))
                current, size = [], 0
            current.append(p)
            size += nbytes
        self.buckets.append(_Bucket(current, current[0].device, current[0].dtype, pad))
        if self.hierarchical:
            for b in self.buckets:
                b.hier = HierarchicalAllReduce(b.buffer, shard_group, replicate_group)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._params = [p for b in self.buckets for p in b.params]
        self._used = UsedMarks(self._params)
        self._next = 0
        self._sync = True
        self._hooks = post_accumulate_hooks(params, self._on_grad)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally without communicating (non-final micro-batches)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def mark_used(self, params) -> None:
        """Mark ``params`` as having a gradient this step (for gradients accumulated outside the
        post-accumulate hooks, e.g. torch.distributed.pipelining's weight pass); no communication."""
        for p in params:
            self._used.mark(p)

    def _on_grad(self, p: nn.Parameter) -> None:
        self._used.mark(p)
        if not self._sync:
            return
        b = self.buckets[self._bucket_of[id(p)]]
        b.ready.add(id(p))
        self._launch_ready()

    def _launch(self, b: _Bucket) -> None:
        if b.hier is not None:  # HSDP: the reduce-scatter now, the rest in finish_grads
            b.hier.launch()
            return
        b.work = comm.all_reduce(b.buffer, group=self.group, async_op=True, tag="grad")

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._next += 1
        if self.hierarchical:  # HSDP: move finished reduce-scatters on to the replica all-reduce, ...
            progress([b.hier for b in self.buckets[:self._next]])

    def finish_grads(self) -> None:
        """Launch the buckets not yet launched (in order) and wait for all reductions.

        Call once per optimizer step after the last backward; afterwards every ``p.grad`` holds the
        sum over dp ranks, and is None for a parameter that no dp rank used in this step."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        self._used.launch(self.group, self.buckets[0].buffer.device)
        if self.hierarchical:
            hierarchical_finish([b.hier for b in self.buckets])
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work = None
            b.ready.clear()
        self._next = 0
        self.sync_tp_replicated()
        for p, used in zip(self._params, self._used.result()):
            if not used:
                p.grad = None  # zero on every rank; the optimizer skips it (zero_grad re-attaches)

    def zero_grad(self) -> None:
        """Zero the flat gradient buffers (grads stay views into them) and the used marks."""
        self._used.reset()
        for b in self.buckets:
            b.buffer.zero_()
            off = 0
            for p in b.params:  # re-attach views if someone set p.grad = None
                if p.grad is None or not _view_at(p.grad, b.buffer, off):
                    p.grad = b.buffer[off:off + p.numel()].view_as(p)
                off += p.numel()

    def grad_bytes(self) -> int:
        """Bytes of gradient storage (sum of bucket buffers)."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)


class TorchDDP(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` with the same interface as :class:`DataParallel`.

    A comm hook replaces DDP's averaging by a SUM all-reduce through ``comm.all_reduce`` (the trainer
    normalises the loss by the global token count). ``find_unused_parameters``: passed to torch DDP
    (an extra autograd-graph traversal per step); needed when some parameter may get no gradient.

    Without it, torch DDP reduces a bucket only once each of its parameters got a gradient in the
    *last* backward of the step (the one outside ``no_sync``); a parameter that got none there --
    unused in the whole step, or used only in earlier micro-batches of the accumulation window, whose
    local ``grad`` is then not None -- leaves its bucket unreduced and the replicas would silently
    diverge (and the next forward fails inside torch). So post-accumulate-grad hooks record, per
    step, the parameters that got a gradient while DDP was syncing (one set insert per parameter per
    synchronised backward; nothing in ``no_sync`` backwards), and :meth:`finish_grads` raises
    ConfigError (one line, naming the first such parameter and the fix) before clipping or the
    optimizer step touch anything. :meth:`zero_grad` clears the marks.

    The check is per rank, with no communication. An all-reduced verdict would not be safer: when a
    parameter reached the last backward on one dp rank and not on another, torch DDP has already
    launched bucket reductions on the first that the second never will, so any further collective on
    the dp group would be paired with the wrong one. Instead, the rank(s) that missed the gradient
    raise; a peer that got it is waiting inside its backward for the bucket reduction that will
    never come and fails as soon as the raising rank's process exits (gloo: "Connection closed by
    peer", raised inside torch's backward, so a traceback rather than one line; no hang). The
    ConfigError line comes from the raising rank.
    When the parameter is missing on every rank (the usual case: the model's own control flow),
    every rank raises the same line together.

    ``ignore``: names (in ``module``) of parameters this DDP leaves alone (torch's
    ``_set_params_and_buffers_to_ignore_for_model``): another synchroniser reduces them (a pipeline
    rank's second chunk sharing the tied weight, ``pipeline.stage_sync``)."""

    def __init__(self, module: nn.Module, group: comm.NamedGroup, bucket_mb: float = 25.0,
                 find_unused_parameters: bool = False, ignore: list[str] = ()):
        self.module, self.group, self.loss_groups = module, group, [group]
        self.find_unused = find_unused_parameters
        dev = next(module.parameters()).device
        if ignore:
            DDP._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
        skip = {id(p) for n, p in module.named_parameters() if n in set(ignore)}
        with warnings.catch_warnings():  # broadcast_buffers is deprecated in 2.13
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            self.ddp = DDP(module, process_group=group.pg, bucket_cap_mb=bucket_mb, broadcast_buffers=False,  # buffers are rebuilt identically per rank
                           device_ids=[dev] if dev.type == "cuda" else None, gradient_as_bucket_view=True,
                           find_unused_parameters=find_unused_parameters)

        def sum_hook(state, bucket):
            buf = bucket.buffer()
            work = comm.all_reduce(buf, group=group, async_op=True, tag="grad")
            return work.get_future().then(lambda fut: fut.value()[0])

        self.ddp.register_comm_hook(None, sum_hook)
        self._sync = True  # False inside no_sync(): DDP does not reduce that backward
        self._synced: set[int] = set()  # ids of parameters that got a gradient in a synchronised backward
        self._mine = [p for p in unique_params(module) if id(p) not in skip]  # what this DDP reduces
        self._hooks = [] if find_unused_parameters else post_accumulate_hooks(self._mine, self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        if self._sync:
            self._synced.add(id(p))

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """torch DDP's ``no_sync`` (accumulate locally; non-final micro-batches)."""
        prev, self._sync = self._sync, False
        try:
            with self.ddp.no_sync():
                yield
        finally:
            self._sync = prev

    def finish_grads(self) -> None:
        """torch DDP's backward already waited for its reductions; only the sequence-parallel
        replicated-gradient sum over tp remains. Without ``find_unused_parameters``, raises
        ConfigError if a parameter got no gradient in this step's synchronised (last) backward on
        this rank, whether or not earlier micro-batches gave it one: torch DDP did not reduce its
        bucket. Nothing has been modified then (no tp sum, no clipping, no optimizer step)."""
        if not self.find_unused and len(self._synced) < len(self._hooks):
            names = {id(p): n for n, p in self.module.named_parameters()}
            for p in self._mine:
                if id(p) not in self._synced:
                    when = "in this step" if p.grad is None else \
                        "in the last micro-batch of this step (only in earlier ones)"
                    raise ConfigError(f"parameter {names[id(p)]} got no gradient {when}; torch DDP would "
                                      "desynchronise the replicas: set parallel.find_unused_parameters = true "
                                      "(or use parallel.dp_impl = native)")
        self.sync_tp_replicated()

    def zero_grad(self) -> None:
        """``grad = None`` (torch DDP re-attaches its bucket views), so a parameter without
        gradient in a step stays None and the optimizer skips it, as on one process; clears the
        marks of the synchronised backward."""
        self._synced.clear()
        for p in unique_params(self.module):
            p.grad = None


def _view_at(t, buffer, off: int) -> bool:
    """Whether ``t`` is a view of ``buffer``'s storage starting at element ``off`` of ``buffer``
    (by storage identity and offset, so that it also holds for the storage-less fake tensors of a
    dry run, ``analysis.dryrun``, whose data pointers are all 0)."""
    return (t.untyped_storage()._cdata == buffer.untyped_storage()._cdata
            and t.storage_offset() == buffer.storage_offset() + off)
