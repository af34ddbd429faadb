"""One ZeRO flat buffer (Rajbhandari et al. 2020): the parameters of one unit that share a
weight-decay flag, padded to a multiple of dp, with this rank's master shard, its shard gradient,
the reduce-scatter of the gradients and the all-gather of the parameters. Used by
:class:`~zerotron.parallel.data.zero.ZeroSync` (stages 1-3; the plain runner's and a pipeline
rank's ZeRO)."""
from __future__ import annotations

import itertools
import os

import torch
import torch.nn as nn

from zerotron.distributed import comm
from zerotron.models.deferred import materialise_params, target_device
from zerotron.parallel.data.disk_state import DiskState
from zerotron.parallel.tensor.layers import is_tp_sharded


class FlatShard:
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
        lo, hi = self.rank * self.k, (self.rank + 1) * self.k
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
            src = self.dev_shard if self.stage == 3 else self.full[self.rank * self.k:(self.rank + 1) * self.k].clone()
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
            self.full[self.rank * self.k:(self.rank + 1) * self.k].copy_(self.master)
        self.release_disk()

    def release_disk(self) -> None:
        """The disk tier: drop the mapped master and Adam state from memory (they stay in the
        file; :meth:`DiskState.release`). No-op otherwise."""
        if self.disk is not None:
            self.disk.release()

    def init_state(self, state: dict) -> None:
        """Create the AdamW state torch creates lazily (step 0, zero moments) in ``state`` if empty:
        the disk tier's moments are the mapped vectors."""
        if state:
            return
        # torch's own rule (optim.adamw): the step count lives on the parameter's device for the fused
        # and capturable kernels (the CUDA fused kernel takes its steps there), on the CPU otherwise
        dev = self.master.device if self.master.device.type != "cpu" else None
        state["step"] = torch.tensor(0.0) if dev is None else torch.zeros((), dtype=torch.float32, device=dev)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = self.disk.tensors[key] if self.disk is not None else \
                torch.zeros_like(self.master, memory_format=torch.preserve_format)

    def free(self) -> None:
        """Release ``full``'s storage (stage 3). An all-gather still writing into it (a prefetch
        whose unit did not run) is waited for first, so no collective ever targets freed memory."""
        self.wait_gather()
        self._set_storage(0)

    @torch.no_grad()
    def adamw_step(self, optimizer) -> None:
        """torch AdamW's update (decoupled decay, bias correction) on this rank's master shard,
        parameter by parameter: only parameters with ``used[j]`` step, each with its own step
        count, so a parameter without gradient keeps its value, moments and step exactly as torch's
        optimizer leaves a parameter whose grad is None. Needs ``master.grad`` (the shard gradient).
        Raises ValueError for amsgrad / maximize groups (not used by zerotron)."""
        group = next(g for g in optimizer.param_groups if any(q is self.master for q in g["params"]))
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("ZeRO per-parameter AdamW step: amsgrad/maximize are not supported")
        state = optimizer.state[self.master]
        self.init_state(state)  # the state torch's AdamW creates lazily
        steps = list(self.steps) if self.steps is not None else [int(state["step"])] * len(self.params)
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        lo, grad = self.rank * self.k, self.master.grad
        for j, (off, n) in enumerate(zip(self.offsets, self.numels)):
            if not self.used[j]:
                continue
            steps[j] += 1  # counted on every rank, whether or not the parameter lies in this shard
            a, b = max(off - lo, 0), min(off + n - lo, self.k)
            if a >= b:
                continue
            p, g, m, v = self.master[a:b], grad[a:b], state["exp_avg"][a:b], state["exp_avg_sq"][a:b]
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / (1 - b2 ** steps[j]) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** steps[j]))
        self.steps = steps if len(set(steps)) > 1 else None
        state["step"] = torch.tensor(float(max(steps)))

    def param_step(self, j: int, state: dict) -> torch.Tensor:
        """AdamW step count of parameter ``j`` (float scalar tensor), given this buffer's state."""
        return torch.tensor(float(self.steps[j])) if self.steps is not None else state["step"].clone()

    @torch.no_grad()
    def canonical_to_flat(self, params: dict, opt_state: dict) -> tuple:
        """``(flat, {"exp_avg", "exp_avg_sq"}, steps or None)``: padded master-dtype full vectors of this
        buffer built from canonical per-parameter tensors (``params[name]`` dense values,
        ``opt_state[name]`` = {"step", "exp_avg", "exp_avg_sq"}); ``steps``: float tensor of the
        per-parameter step counts (0 for a parameter without state), None if none has state."""
        flat = torch.zeros(self.padded, dtype=self.master_dtype)
        st = {k: torch.zeros(self.padded, dtype=self.master_dtype) for k in ("exp_avg", "exp_avg_sq")}
        steps = torch.zeros(len(self.params))
        for j, (name, off, n) in enumerate(zip(self.names, self.offsets, self.numels)):
            flat[off:off + n] = params[name].reshape(-1).to(self.master_dtype).cpu()
            if name in opt_state:
                for k in st:
                    st[k][off:off + n] = opt_state[name][k].reshape(-1).to(self.master_dtype).cpu()
                steps[j] = float(opt_state[name]["step"])
        return flat, st, steps if any(name in opt_state for name in self.names) else None

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor, st: dict, step, optimizer) -> None:
        """Set this rank's master shard (and its AdamW state when ``step`` is not None: one count, or
        one per parameter) from padded full vectors (:meth:`canonical_to_flat`). Parameters
        (compute copies) are not re-gathered."""
        lo, hi = self.rank * self.k, (self.rank + 1) * self.k
        self.settle_arrival()
        self.master.copy_(flat[lo:hi])
        self.master_to_device()
        if step is not None and not self.frozen:
            state = optimizer.state[self.master]
            steps = [int(x) for x in torch.as_tensor(step, dtype=torch.float64).reshape(-1).tolist()]
            steps = steps * len(self.params) if len(steps) == 1 else steps
            self.steps = steps if len(set(steps)) > 1 else None
            state["step"] = torch.tensor(float(max(steps)))
            for k in st:
                if self.disk is not None:  # into the mapped vectors
                    state[k] = self.disk.tensors[k]
                    state[k].copy_(st[k][lo:hi])
                else:
                    state[k] = st[k][lo:hi].clone().to(self.master.device)
        self.release_disk()

    def load_canonical(self, params: dict, opt_state: dict, optimizer) -> None:
        """:meth:`load_flat` of :meth:`canonical_to_flat` (every rank holds the full state)."""
        self.load_flat(*self.canonical_to_flat(params, opt_state), optimizer)


def build_flats(units: list[list], names: dict, mask: dict, stage: int, group, compute_dtype, reduce_dtype,
                tied=None, offload: str = "none", group_of: dict | None = None,
                disk_dir: str | None = None) -> list[list[FlatShard]]:
    """The flat buffers of each unit (a list of Parameters): one per (trainable, weight-decay flag,
    tp-sharded, shard group) present, in that fixed order (trainable first, decay first, tp-sharded
    first, ``group`` first, then the other groups in the order their parameters appear), so
    tensor-parallel shards and tp-replicated parameters, frozen (LoRA base) and trainable parameters,
    and parameters sharded over different groups never share a buffer. ``names``: ``{id(param):
    FQN}``; ``mask``: ``{id(param): decay?}``; ``tied``: the Parameter marked ``is_tied`` (its unit
    should hold it alone); ``offload``: ``train.offload`` (see :class:`FlatShard`; ``optimizer-disk``
    maps ``disk_dir/flat-<pid>-<i>.bin`` for the i-th buffer: two runs sharing a folder never meet); ``group_of``: ``{id(param): group}`` for
    parameters sharded over another group than ``group`` (expert parameters over their
    expert-replica group, ``parallel.expert``). Each FlatShard gets ``tp_sharded`` and ``is_tied``.
    Collective-free."""
    group_of = group_of or {}
    out = []
    with torch.no_grad():
        for params in units:
            flats = []
            groups = [group] + list({id(g): g for g in (group_of[id(p)] for p in params if id(p) in group_of)
                                     if g is not group}.values())
            for train, decay, sharded in itertools.product((True, False), repeat=3):
                for g in groups:
                    ps = [p for p in params if p.requires_grad == train and mask.get(id(p), False) == decay
                          and is_tp_sharded(p) == sharded and group_of.get(id(p), group) is g]
                    if ps:
                        path = f"{disk_dir}/flat-{os.getpid()}-{sum(map(len, out)) + len(flats)}.bin" if disk_dir else None
                        f = FlatShard([names[id(p)] for p in ps], ps, decay, stage, g, compute_dtype,
                                      reduce_dtype, offload, path)
                        f.tp_sharded, f.is_tied = sharded, tied is not None and ps[0] is tied
                        flats.append(f)
            out.append(flats)
    return out


def flat_state_bytes(flats: list, optimizer) -> dict:
    """Bytes held now by ZeRO flat buffers ``flats``: parameters (compute copies; the fp32 master
    too when it is the parameter itself), gradients (full buffers of stage 1 or fp32 shards),
    optimizer (Adam state + fp32 master shards of mixed precision). Returns ``{"params_bytes",
    "grads_bytes", "optimizer_bytes", "total_bytes"}`` (ints, bytes, on the device); with
    ``train.offload = optimizer`` also ``host_bytes`` (master shards, their Adam state and the host
    gradient shards) and ``disk_bytes`` (0), and ``optimizer_bytes`` is 0; with ``optimizer-disk``
    the master shards and Adam state count as ``disk_bytes`` (the file's vectors, unpadded) and
    ``host_bytes`` holds only host gradient shards (none on a CPU-only machine). Offloaded, the host
    bytes are also split by part: ``host_params_bytes`` (``train.offload = params``: the host compute
    shards, the master when it is the compute shard), ``host_grads_bytes``, ``host_optimizer_bytes``
    (masters and Adam state); they sum to ``host_bytes``."""
    p = g = o = hp = hg = ho = d = 0
    for f in flats:
        p += f.full.untyped_storage().size()
        master = f.master.numel() * f.master.element_size()
        if f.params_offload and f.frozen:  # the compute-dtype master is the host shard
            hp += master
            continue
        if f.offload:
            p += f.dev_shard.numel() * f.dev_shard.element_size() if f.dev_shard is not None else 0
            g += 0 if f.grad_aliased else f.shard_grad.numel() * f.shard_grad.element_size()
            g += f.grad_full.numel() * f.grad_full.element_size() if f.grad_full is not None else 0
            hg += f.host_grad.numel() * f.host_grad.element_size() if f.host_grad is not None else 0
            if f.disk is not None:
                d += 3 * master
                continue
            if f.host_shard is not None:  # params offload: the master serves as the compute shard, or a copy
                hp += master if f.host_shard is f.master or f.host_shard.data_ptr() == f.master.data_ptr() \
                    else f.host_shard.numel() * f.host_shard.element_size()
            shares = f.host_shard is not None and f.host_shard.data_ptr() == f.master.data_ptr()
            ho += (0 if shares else master) + sum(t.numel() * t.element_size()
                                                  for t in optimizer.state.get(f.master, {}).values()
                                                  if isinstance(t, torch.Tensor) and t.dim() > 0)
            continue
        if f.stage == 3 and f.compute_dtype == f.master_dtype:
            p += master
        elif not f.aliased:
            o += master
        if f.grad_full is not None:
            g += f.grad_full.numel() * f.grad_full.element_size()
        if not (f.stage == 1 and f.aliased):
            g += f.shard_grad.numel() * f.shard_grad.element_size()
        for t in optimizer.state.get(f.master, {}).values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                o += t.numel() * t.element_size()
    out = {"params_bytes": p, "grads_bytes": g, "optimizer_bytes": o, "total_bytes": p + g + o}
    if any(f.offload or f.params_offload for f in flats):
        out.update(host_bytes=hp + hg + ho, disk_bytes=d, host_params_bytes=hp, host_grads_bytes=hg,
                   host_optimizer_bytes=ho)
    return out
