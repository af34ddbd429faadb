"""ZeRO stage 3 parameter gathering (Rajbhandari et al. 2020, sec. 5.3): a block's flat parameters
are all-gathered just before its forward and again before its backward, and freed (storage resized
to 0) right after; the next block's all-gather is prefetched asynchronously so communication
overlaps compute. Forward prefetches the block that followed this one in the previous forward
(i+1 the first time), backward the block whose forward ran just before. Any module order is safe
(skipped, reordered, data-dependent blocks -- the same on every dp rank, as collectives must
match): a unit is always gathered and waited for before use, a prefetched unit that does not run is
waited for before its storage is released, and nothing gathered outlives the step. Root units
(parameters outside the blocks) are gathered by the owner at the start of a step and kept until it
ends. Used by :class:`~zerotron.parallel.data.zero.ZeroSync` (the plain runner's and a pipeline
rank's ZeRO). Full activation recomputation (``parallel.recompute``) needs nothing more: the
pre-backward gather sits on the block's output, outside the checkpointed region, so it runs before
the recompute of the block's forward. :class:`ZeroGatherMixin` is ``ZeroSync``'s side of it: the
roots for a step, the blocks for a W pass, every unit for a full-parameters context."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["UnitGatherer", "ZeroGatherMixin"]


class _PreBackward(torch.autograd.Function):
    """Identity whose backward first runs ``unit_hook`` (gather the block's parameters before its
    backward and prefetch the previous block)."""

    @staticmethod
    def forward(ctx, hook, x):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad


class UnitGatherer:
    """Gathers and frees the stage-3 flat buffers of ``flats`` (``flats[u]``: the FlatShards of unit
    u; units ``0 .. n_root-1`` are roots, the rest blocks). :meth:`register` installs the forward
    hooks on the block modules (``blocks[i]`` is unit ``n_root + i``)."""

    def __init__(self, flats: list, n_root: int):
        self.flats, self.n_root = flats, n_root
        self.fwd_units: list[int] = []  # block units in the order their forward ran
        self.fwd_next: dict[int, int] = {}  # unit -> unit whose forward followed it last time (-1: none)
        self.hold = 0  # > 0 inside a full-parameters context: forwards do not free their unit
        self.deferred: list[int] = []  # units whose backward may still read their (frozen) buffers

    def register(self, blocks) -> None:
        for u, b in enumerate(blocks, start=self.n_root):
            b.register_forward_pre_hook(self._make_pre_forward(u))
            b.register_forward_hook(self._make_post_forward(u))

    def gather(self, u: int, wait: bool = True) -> None:
        """All-gather unit ``u`` (no-op if gathered); ``wait`` for it."""
        for f in self.flats[u]:
            f.launch_gather()
        if wait:
            for f in self.flats[u]:
                f.wait_gather()

    def gather_roots(self) -> None:
        for u in range(self.n_root):
            self.gather(u)

    def free(self, u: int) -> None:
        for f in self.flats[u]:
            f.free()

    def defer_free(self, u: int) -> None:
        """Free unit ``u`` at the next pre-backward gather of another unit (by then ``u``'s
        backward is over: its input gradient is complete) or at :meth:`free_deferred`. For units
        with frozen buffers, whose trainable gradients can be complete before the input gradient
        through the frozen weights is computed."""
        if u not in self.deferred:
            self.deferred.append(u)

    def free_deferred(self, keep: int = -1) -> None:
        """Free the deferred units (except ``keep``, which stays deferred)."""
        if self.hold:
            return
        for u in self.deferred:
            if u != keep:
                self.free(u)
        self.deferred = [u for u in self.deferred if u == keep]

    def release_all(self) -> None:
        """Free every unit's storage, waiting first for any prefetch still in flight."""
        self.deferred = []
        for fl in self.flats:
            for f in fl:
                f.free()

    def new_forward(self) -> None:
        """Start recording a forward's block order; the previous forward's last block is marked as
        followed by nothing."""
        if self.fwd_units:
            self.fwd_next[self.fwd_units[-1]] = -1
        self.fwd_units = []

    def _make_pre_forward(self, u: int):
        def hook(module, args):
            self.gather(u)
            order = self.fwd_units
            if torch.is_grad_enabled():  # learn the real module order (prefetch targets)
                if order:
                    self.fwd_next[order[-1]] = u
                order.append(u)
            nxt = self.fwd_next.get(u, u + 1)  # what ran after u last time; the first time u + 1
            if self.n_root <= nxt < len(self.flats) and nxt != u:
                self.gather(nxt, wait=False)  # prefetch; released (after a wait) if it does not run
        return hook

    def _make_post_forward(self, u: int):
        def hook(module, args, output):
            if not self.hold:
                self.free(u)
            if torch.is_grad_enabled() and output.requires_grad:
                order = self.fwd_units
                prev = order[-2] if len(order) >= 2 and order[-1] == u else None  # backward runs it next

                def pre_backward():
                    self.free_deferred(keep=u)
                    self.gather(u)
                    if prev is not None and prev != u:
                        self.gather(prev, wait=False)  # prefetch the block that ran before
                return _PreBackward.apply(pre_backward, output)
            return output
        return hook


class ZeroGatherMixin:
    """Stage 3's parameters for a step or a context, for :class:`~zerotron.parallel.data.zero.ZeroSync`
    (attributes used: ``stage``, ``flats``, ``n_root``, ``eager``, ``offload``, ``gatherer``, a
    :class:`UnitGatherer`; the offload mixin's ``settle``). Stages 1-2 keep parameters full at rest:
    these methods then only wait for an offloaded step's updated parameters."""

    def begin_step(self) -> None:
        """Stage 3: gather the root units for the step (used at both ends of the model). Stages
        1-2 with offload: the plain runner waits here for the root units' updated parameters (each
        block waits for its own in its forward, ``ZeroSync._arrive``), a pipeline for every unit's."""
        if self.stage == 3:
            self.gatherer.gather_roots()
        elif self.offload:
            self.settle(range(self.n_root) if self.eager else None)

    def end_step(self) -> None:
        """Stage 3: nothing gathered (or still gathering) survives the step."""
        if self.stage == 3:
            self.gatherer.release_all()

    def gather_blocks(self, units) -> None:
        """Stage 3: all-gather the block units among ``units`` (a W of a split backward reads the
        weights: saved tensors, recomputation); ``ZeroSync.after_backward`` frees them. Else nothing."""
        if self.stage == 3:
            for u in units:
                if u >= self.n_root:
                    self.gatherer.gather(u)

    @contextlib.contextmanager
    def full_params(self, blocks: bool = True):
        """Stage 3: the root units (and every block when ``blocks``; otherwise the blocks' forward
        hooks gather them one at a time) gathered for the context (evaluation, generation, export,
        state dicts); freed on exit. Stages 1-2: nothing to do (parameters are full at rest) but
        to wait for the updated parameters of an offloaded step (``ZeroSync.settle``)."""
        self.settle()
        if self.stage == 3:
            for u in range(len(self.flats) if blocks else self.n_root):
                self.gatherer.gather(u)
            self.gatherer.hold += blocks  # everything gathered: forwards (e.g. generate) keep it
        try:
            yield
        finally:
            if self.stage == 3:  # also blocks a gradient-free forward prefetched but did not run
                self.gatherer.hold -= blocks
                self.gatherer.release_all()
