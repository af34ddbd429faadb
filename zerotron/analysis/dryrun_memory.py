"""The memory side of a dry run (``analysis.dryrun``): a ``torch.distributed._tools.MemTracker``
that answers ``.item()`` on fake tensors and records the moment of the peak and of the first
overflow, the labelling of the model states by category as the strategy counts them, and the
bytes of tensors no operator makes (which a dispatch-level tracker cannot see)."""
from __future__ import annotations

import weakref

import torch

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "other")
"""Memory categories of a record (MemTracker's Parameter, Gradient, Optstate, Activation, Temp;
Buffer and Other together as "other")."""


def _scalar(t: torch.Tensor):
    """The stand-in for a value read back from a fake tensor (the dry run traces no numerics)."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.dtype.is_floating_point or t.dtype.is_complex else 1


def _released_once_fired(original):
    """``torch.autograd.graph.register_multi_grad_hook`` whose hooks remove themselves at the end of
    the backward that fired them. ModTracker (inside MemTracker) registers one on every module's
    inputs; in mode "all" its closure keeps the inputs' gradient nodes, and for a leaf input (a
    pipeline stage's received activation, made to require grad) that node is the leaf's
    AccumulateGrad, which owns the leaf: leaf -> its hooks -> closure -> AccumulateGrad -> leaf, a
    cycle through autograd's C++ node that Python's collector cannot break. The leaf and its .grad
    then outlived the step in every dry run of a pipeline stage > 0 (the last stage of Llama-3-8B
    at 8 micro-batches: 2 x 1 GiB, 8 inputs and 8 input gradients of (1, 8192, 4096) fp32), which a
    real run, without the tracker, does not hold."""
    def register(tensors, fn, *, mode="all"):
        handle = None

        def once(*args):
            fn(*args)
            torch.autograd.Variable._execution_engine.queue_callback(handle.remove)

        handle = original(tensors, once, mode=mode)
        return handle

    return register


def tracker_class():
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        """MemTracker that answers ``.item()`` on fake tensors (:func:`_scalar`), records the moment
        of the peak (``phase`` set by the driver, innermost module, forward/backward) and the first
        moment the total exceeds ``limit`` bytes (with the category that grew)."""

        def __init__(self, limit: int | None = None):
            super().__init__()
            self.phase, self.limit, self.peak_at, self.oom, self._last = "setup", limit, None, None, None
            self._seen = weakref.WeakSet()

        def __enter__(self):
            if self._depth == 0:  # see _released_once_fired
                self._multi_grad_hook = mod_tracker.register_multi_grad_hook
                mod_tracker.register_multi_grad_hook = _released_once_fired(self._multi_grad_hook)
            return super().__enter__()

        def __exit__(self, *args):
            super().__exit__(*args)
            if self._depth == 0:
                mod_tracker.register_multi_grad_hook = self._multi_grad_hook

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return _scalar(args[0])
            return super().__torch_dispatch__(func, types, args, kwargs)

        def moment(self) -> dict:
            mods = [m for m in self._mod_tracker.parents if m != "Global"]
            return {"phase": self.phase, "module": max(mods, key=lambda m: (m.count("."), m)) if mods else None,
                    "pass": "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"}

        # module hooks: label each module's parameters (and gradient hooks) once, and mark the
        # recomputation region (a forward inside the backward); no per-module snapshots (MemTracker's
        # refuse a module called twice: micro-batches, pipeline chunks)
        def _pre_fw_hook(self, module, inputs) -> None:
            if module not in self._seen:
                self._seen.add(module)
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
            elif self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _pre_bw_hook(self, module, args) -> None:
            pass

        def _post_bw_hook(self, module, args) -> None:
            pass

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_at = self.moment()
            if self.limit is not None and self.oom is None:
                now = categories(self._curr_mem_snap)
                if now["total"] > self.limit:
                    last = self._last or dict.fromkeys(now, 0)
                    grew = max(CATEGORIES, key=lambda c: now[c] - last[c])
                    self.oom = {**self.moment(), "category": grew, "total_bytes": now["total"], "categories": now}
                self._last = now

        def categorize(self, t, kind: str) -> None:
            if t is not None and t.untyped_storage().nbytes():
                self._update_and_maybe_create_winfos(t, getattr(_MemRefType, kind))

    return Tracker


def categories(snap: dict) -> dict:
    """Bytes per category of a MemTracker snapshot ({device: {reftype: bytes}}), summed over devices
    (the meta device left out)."""
    out = dict.fromkeys(CATEGORIES, 0)
    names = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer", "Activation": "activations",
             "Temp": "temporary", "Buffer": "other", "Other": "other"}
    total = 0
    for device, dev in snap.items():
        if getattr(device, "type", device) == "meta":  # a deferred-init model's shapes: no memory
            continue
        for k, v in dev.items():
            key = getattr(k, "value", k)
            if key == "Total":
                total += v
            else:
                out[names[key]] += v
    out["total"] = total
    return out


def categorize(tracker, strategy, optimizer) -> None:
    """Label the storages of the model states, as ``Strategy.model_state_bytes`` counts them:
    ZeRO flat buffers as ``flat_state_bytes`` (compute copy = parameters; fp32 master = optimizer
    state, or parameters for stage 3 without a compute copy; full and shard gradients), otherwise
    the module's parameters, their ``.grad``, the optimizer's own parameters (master copies) and
    its state tensors."""
    zero = getattr(strategy, "zero", None) or strategy
    flats = getattr(zero, "all_flats", None)
    for st in optimizer.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                tracker.categorize(t, "OPT")
    for g in optimizer.param_groups:
        for p in g["params"]:
            tracker.categorize(p, "OPT")
            tracker.categorize(p.grad, "GRAD")
    if flats:
        for f in flats:
            if f.stage == 3 and f.compute_dtype == f.master_dtype:
                tracker.categorize(f.master, "PARAM")
            tracker.categorize(f.grad_full, "GRAD")
            tracker.categorize(f.shard_grad, "GRAD")
    for p in strategy.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        tracker.categorize(local, "PARAM")
        if p.grad is not None:
            tracker.categorize(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, "GRAD")
    if flats:
        for f in flats:
            tracker.categorize(f.full, "PARAM")


def not_dispatched(module) -> int:
    """Bytes a rank holds in tensors that no operator made, which a tracker of dispatched operators
    cannot see: the tensor-parallel RNG tracker's generator states (``torch.Generator.get_state``,
    5,056 bytes each on CPU; ``parallel.tensor.transform.RNGStatesTracker``). They live through the
    whole step (a ``fork`` replaces one by its successor and, while it runs, holds the outer
    generator's state too: at most two states more, inside a dropout)."""
    from zerotron.parallel.tensor.transform import find_rng_tracker

    rng = find_rng_tracker(module)
    return sum(t.untyped_storage().nbytes() for t in rng.states.values()) if rng is not None else 0
