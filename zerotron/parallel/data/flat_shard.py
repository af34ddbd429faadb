"""One ZeRO flat buffer (Rajbhandari et al. 2020): the parameters of one unit that share a
weight-decay flag, padded to a multiple of dp, with this rank's master shard, its shard gradient,
the reduce-scatter of the gradients and the all-gather of the parameters, and offload's copies
between device and host. Its optimizer state (the per-parameter AdamW step, the checkpoint
conversion) is :mod:`zerotron.parallel.data.flat_state`'s; how a unit's parameters are grouped into
buffers, :mod:`zerotron.parallel.data.flat_units`'. Used by
:class:`~zerotron.parallel.data.zero.ZeroSync` (stages 1-3; the plain runner's and a pipeline
rank's ZeRO).

Layout: a buffer of ``numel`` elements is padded to ``padded = k * dp``, ``k = ceil(numel / dp)``;
parameter j lies at ``[offsets[j], offsets[j] + numels[j])``; dp rank r owns ``[r*k, (r+1)*k)``
(:attr:`FlatShard.shard_bounds`)."""
from __future__ import annotations

import torch
import torch.nn as nn

from zerotron.distributed import comm
from zerotron.models.deferred import materialise_params, target_device
from zerotron.parallel.data.disk_state import DiskState
from zerotron.parallel.data.flat_state import FlatStateMixin

__all__ = ["FlatShard"]


class FlatShard(FlatStateMixin):
    """Parameters of one unit sharing a weight-decay flag, stored as one padded flat buffer.

    Attributes: ``names`` (FQNs), ``params``, ``offsets``, ``numel`` (unpadded), ``padded``, ``k``
    (shard size), ``full`` (padded flat compute copy; module params are views into it),
    ``master`` (shard in ``master_dtype``: float32, or float64 when the compute dtype is; an
    ``nn.Parameter`` given to the optimizer).

    ``offload = "optimizer"`` (``train.offload``; ZeRO-Offload, Ren et al. 2021): the master shard
    lives in its own host-memory buffer (pinned on CUDA), never a view of ``full``, so the
    optimizer's Adam state is created on the host too; ``host_grad`` (host) receives the shard
    gradient as soon as its last reduction is done (:meth:`grad_to_host`, a background copy the
    driver starts during backward; the norm and the clip then run on it) and the updated master is
    copied back into the device's compute shard in the background after the step
    (:meth:`send_to_device` runs :meth:`master_to_device`: ``full[lo:hi]`` at stages 1-2,
    ``dev_shard`` at stage 3, which gathers from it; :meth:`launch_gather` waits for that copy
    first, ``arrival``). On a CPU-only machine host and device are the same memory: the mechanism
    runs as the same copies between distinct buffers (``host_copies``).

    ``offload = "optimizer-disk"`` (the disk tier, ZeRO-Infinity, Rajbhandari et al. 2021): the same,
    but the master shard and its Adam moments are vectors of a memory-mapped file at ``disk_path``
    (``disk``, a :class:`~zerotron.parallel.data.disk_state.DiskState`), streamed chunk by chunk
    through staging buffers by I/O threads for the step (``disk_state.disk_step``) and released
    from memory after other uses; on a CPU-only machine the gradient is read from ``shard_grad``
    directly (no ``host_grad``).

    ``offload = "params"`` (stage 3 only; ZeRO-Infinity's parameter offload, Rajbhandari et al. 2021):
    everything of ``"optimizer"``, and the compute-dtype parameter shard rests on the host too
    (``host_shard``, pinned on CUDA; the master itself when the compute dtype is the master dtype, so
    fp32 and fp64 keep one host copy) instead of the device's ``dev_shard``: each all-gather first
    copies it into a fresh device buffer (:meth:`launch_gather`), so between uses the device holds
    nothing of the buffer. ``params_offload`` is True then (also for a frozen buffer, whose
    compute-dtype ``master`` is then the host shard).

    ``frozen`` (the parameters have ``requires_grad = False``: a LoRA base): the buffer still holds
    and shards the parameters (stage 3 gathers them for compute), but has no gradient (``grad_full``
    None, an empty ``shard_grad``), no reduce-scatter, no optimizer state and no offload; its
    ``master`` is the compute-dtype shard (the all-gather source at stage 3), never given to the
    optimizer (``ZeroSync.grad_flats`` leaves it out)."""

    def __init__(self, names, params, decay: bool, stage: int, group, compute_dtype, reduce_dtype,
                 offload: str = "none", disk_path: str | None = None):
        if len({p.requires_grad for p in params}) > 1:
            raise ValueError(f"a ZeRO flat buffer mixes frozen and trainable parameters: {names[0]} ...")
        self.names, self.params, self.decay, self.stage, self.group = names, params, decay, stage, group
        self.dp, self.rank = group.size(), group.rank()
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.frozen = not params[0].requires_grad
        self.params_offload = offload == "params" and stage == 3
        if self.frozen:
            offload = "none"
        self.master_dtype = compute_dtype if self.frozen else \
            torch.float64 if compute_dtype == torch.float64 else torch.float32
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.k = -(-self.numel // self.dp)
        self.padded = self.k * self.dp
        dev = target_device(params[0])
        self.full = torch.zeros(self.padded, dtype=compute_dtype, device=dev)
        with torch.no_grad():
            for p, off, n in zip(params, self.offsets, self.numels):
                materialise_params([p])  # a deferred-init (meta) parameter: its dense values, one at a time
                self.full[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.full[off:off + n].view_as(p)
        lo, hi = self.shard_bounds
        self.offload = offload in ("optimizer", "optimizer-disk", "params")
        # master is a view of `full` (no offload, same dtype, parameters full at rest)
        self.aliased = compute_dtype == self.master_dtype and stage < 3 and not self.offload
        self.dev_shard = self.host_grad = self.disk = self.host_shard = None
        host, pin = torch.device("cpu"), dev.type == "cuda"
        if self.offload:
            if offload == "optimizer-disk":
                self.disk = DiskState(disk_path, self.k, self.master_dtype)
                shard = self.disk.tensors["master"]
            else:
                shard = torch.empty(self.k, dtype=self.master_dtype, device=host, pin_memory=pin)
            shard.copy_(self.full[lo:hi])
            if self.disk is not None:
                self.disk.release()
            if self.disk is None or dev.type != "cpu":  # the disk tier on the host device reads shard_grad
                self.host_grad = torch.zeros(self.k, dtype=self.master_dtype, device=host,
                                             pin_memory=dev.type == "cuda")
            if self.params_offload:  # the compute shard the all-gathers read, at rest on the host
                self.host_shard = shard if compute_dtype == self.master_dtype else \
                    torch.empty(self.k, dtype=compute_dtype, device=host, pin_memory=pin).copy_(self.full[lo:hi])
            elif stage == 3:  # the compute shard the all-gathers read (parameters at rest on the device)
                self.dev_shard = self.full[lo:hi].clone()
        elif self.params_offload:  # frozen: the compute-dtype master is the host shard
            shard = self.host_shard = torch.empty(self.k, dtype=compute_dtype, device=host,
                                                  pin_memory=pin).copy_(self.full[lo:hi])
        else:
            shard = self.full[lo:hi] if self.aliased else self.full[lo:hi].to(self.master_dtype).clone()
        self.master = nn.Parameter(shard, requires_grad=not self.frozen)
        self.grad_full = None
        if stage == 1 and not self.frozen:  # full gradients accumulate in place (param.grad views)
            self.grad_full = torch.zeros(self.padded, dtype=compute_dtype, device=dev)
            self.attach_grad_views()
        self.shard_grad = torch.zeros(0 if self.frozen else self.k, dtype=self.master_dtype, device=dev)
        self.grad_aliased = compute_dtype == self.master_dtype and stage == 1 and not self.frozen  # a view of grad_full
        if self.grad_aliased:
            self.shard_grad = self.grad_full[lo:hi]
        self.pending = None  # (work, input, output) of an in-flight reduce-scatter
        self.gather_work = None
        self.arrival = None  # offload: (HostCopies, Future) of the host -> device copy after a step
        self.stale = False  # stages 1-2 offload: the all-gather of the updated shards is still to come
        self.used = [True] * len(params)  # per parameter: got a gradient on some dp rank this step
        self.steps = None  # per-parameter AdamW steps once they differ (None: all = state["step"])
        if stage == 3:
            self._set_storage(0)

    @property
    def shard_bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: this rank's shard of the padded buffer, elements ``[rank*k, (rank+1)*k)``."""
        return self.rank * self.k, (self.rank + 1) * self.k

    def _set_storage(self, nbytes: int) -> None:
        """Resize ``full``'s storage to ``nbytes`` (0 frees it: stage 3 parameters at rest).

        Raises RuntimeError while an all-gather into ``full`` is pending: the collective would
        write into freed or moved memory (SIGSEGV, "out of bounds for storage of size 0")."""
        if self.gather_work is not None:
            raise RuntimeError(f"ZeRO internal error: resizing the flat buffer of {self.names[0]} while its "
                               "all-gather is pending")
        storage = self.full.untyped_storage()
        if storage.size() == nbytes:
            return
        if not storage.resizable():  # pinned, e.g. by a .numpy() view a caller took: a fresh buffer
            self.full = torch.empty(0, dtype=self.full.dtype, device=self.full.device).set_(
                torch.empty(0, dtype=torch.uint8, device=self.full.device).untyped_storage(), 0, self.full.shape)
            with torch.no_grad():
                for p, off, n in zip(self.params, self.offsets, self.numels):
                    p.data = self.full[off:off + n].view_as(p)
            storage = self.full.untyped_storage()
        storage.resize_(nbytes)

    def zero_grad(self) -> None:
        """Clear the shard gradient and the parameters' gradients (stage 1: zero the full buffer and
        re-attach the ``param.grad`` views into it; stages 2-3: ``param.grad = None``). Frozen: nothing."""
        if self.frozen:
            return
        self.shard_grad.zero_()
        self.master.grad = None
        if self.stage == 1:
            self.grad_full.zero_()
            self.attach_grad_views()
        else:
            for p in self.params:
                p.grad = None

    def attach_grad_views(self) -> None:
        for p, off, n in zip(self.params, self.offsets, self.numels):
            p.grad = self.grad_full[off:off + n].view_as(p)

    # ---- gradients -------------------------------------------------------------------------
    def launch_reduce(self) -> None:
        """Reduce-scatter this buffer's gradient (async); stage 2/3 free the full gradients.
        Frozen: nothing (no gradient)."""
        if self.frozen:
            return
        if self.stage == 1:
            inp = self.grad_full if self.grad_full.dtype == self.reduce_dtype else self.grad_full.to(self.reduce_dtype)
        else:
            inp = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.full.device)
            for p, off, n in zip(self.params, self.offsets, self.numels):
                if p.grad is not None:
                    inp[off:off + n].copy_(p.grad.reshape(-1))
                    p.grad = None
        out = torch.empty(self.k, dtype=self.reduce_dtype, device=inp.device)
        work = comm.reduce_scatter(out, inp, group=self.group, async_op=True, tag="grad")
        self.pending = (work, inp, out)

    def wait_reduce(self) -> None:
        """Finish the in-flight reduce-scatter and accumulate into the master-dtype shard gradient."""
        if self.pending is None:
            return
        work, _, out = self.pending
        work.wait()
        if self.stage == 1:
            self.shard_grad.copy_(out)
        else:
            self.shard_grad.add_(out.to(self.master_dtype))
        self.pending = None

    # ---- parameters ------------------------------------------------------------------------
    def launch_gather(self) -> None:
        """All-gather the master shards into ``full`` (async). Stage 3: re-allocates ``full``;
        ``params_offload``: the host shard is first copied into a fresh device buffer (the
        all-gather's input, freed with the gather)."""
        if self.gather_work is not None:
            return
        if self.stage == 3 and self.full.untyped_storage().size() > 0:
            return  # already gathered
        self.settle_arrival()
        self._set_storage(self.full.numel() * self.full.element_size())
        if self.params_offload:  # host -> device, then gather on the device
            src = torch.empty(self.k, dtype=self.compute_dtype, device=self.full.device)
            src.copy_(self.host_shard, non_blocking=self.host_shard.is_pinned())
        elif self.offload:  # the device's compute shard (:meth:`master_to_device`), not the host master
            src = self.dev_shard if self.stage == 3 else self.full[slice(*self.shard_bounds)].clone()
        else:
            src = self.master.detach() if self.master.dtype == self.compute_dtype else \
                self.master.detach().to(self.compute_dtype)
        if self.aliased:
            src = src.clone()  # input must not alias the output buffer
        self.gather_work = (comm.all_gather(self.full, src, group=self.group, async_op=True, tag="param"), src)

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work[0].wait()
            self.gather_work = None

    def grad_to_host(self, copies):
        """Offload: start copying the (reduced, final) device shard gradient into ``host_grad``, the
        master's gradient for the host step, on ``copies`` (a ``host_copies.HostCopies``); returns
        its Future, or None without a host gradient (no offload; the disk tier on a CPU-only
        machine steps from ``shard_grad``)."""
        if self.host_grad is None:
            return None
        return copies.copy(self.host_grad, self.shard_grad)

    def send_to_device(self, copies) -> None:
        """Offload, after a step: :meth:`master_to_device` in the background on ``copies``; the next
        :meth:`launch_gather` (or :meth:`settle_arrival`) waits for it."""
        self.settle_arrival()
        self.arrival = (copies, copies.run(self.master_to_device))

    def settle_arrival(self) -> None:
        """Wait for the background :meth:`send_to_device` copy, if one is pending."""
        if self.arrival is not None:
            copies, fut = self.arrival
            self.arrival = None
            copies.wait(fut)

    @torch.no_grad()
    def master_to_device(self) -> None:
        """Offload: copy the host master (after a step or a load) into the compute shard that the
        next all-gather reads (``full[lo:hi]`` at stages 1-2, ``dev_shard`` at 3; ``params_offload``:
        ``host_shard``, nothing to do when it is the master itself)."""
        if not self.offload:
            return
        if self.params_offload:
            if self.host_shard is not self.master and self.host_shard.data_ptr() != self.master.data_ptr():
                self.host_shard.copy_(self.master)
        elif self.stage == 3:
            self.dev_shard.copy_(self.master)
        elif self.full.untyped_storage().size() > 0:
            self.full[slice(*self.shard_bounds)].copy_(self.master)
        self.release_disk()

    def release_disk(self) -> None:
        """The disk tier: drop the mapped master and Adam state from memory (they stay in the
        file; :meth:`DiskState.release`). No-op otherwise."""
        if self.disk is not None:
            self.disk.release()

    def free(self) -> None:
        """Release ``full``'s storage (stage 3). An all-gather still writing into it (a prefetch
        whose unit did not run) is waited for first, so no collective ever targets freed memory."""
        self.wait_gather()
        self._set_storage(0)
