"""The optimizer state of one ZeRO flat buffer (:class:`~zerotron.parallel.data.flat_shard.FlatShard`'s
:class:`FlatStateMixin`): the AdamW state torch creates lazily, the per-parameter AdamW step of a
buffer used in part (each parameter with its own step count, as torch's AdamW on one process), and
the conversion between the canonical per-parameter form of checkpoints and this rank's shard.

Attributes used (set by ``FlatShard.__init__``): ``names``, ``params``, ``offsets``, ``numels``,
``padded``, ``k``, ``master``, ``master_dtype``, ``frozen``, ``disk``, ``used``, ``steps``,
:attr:`~zerotron.parallel.data.flat_shard.FlatShard.shard_bounds`; the offload copies ``settle_arrival``, ``master_to_device`` and
``release_disk``."""
from __future__ import annotations

import torch

__all__ = ["FlatStateMixin"]


class FlatStateMixin:
    """AdamW state and checkpoint conversion of one flat buffer (see the module docstring)."""

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
        lo, grad = self.shard_bounds[0], self.master.grad
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
        lo, hi = self.shard_bounds
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
