"""Checkpoint state of native ZeRO (:class:`zerotron.parallel.data.zero.ZeroSync`) in the canonical per-parameter
format (``train.checkpoint``): dense FQN-keyed tensors, loadable by any layout.

Two ways to get it:

* :meth:`ZeroStateMixin.state_dict` -- the whole state on every rank (tests, tools). Transiently
  materialises the full model and optimizer state on each rank.
* :meth:`ZeroStateMixin.checkpoint_state` -- what a checkpoint save/load uses. The flat buffers are
  dealt round-robin to the dp ranks (buffer i -> dp rank i mod dp; all tp ranks of that dp
  coordinate hold the same keys). Each rank returns only its buffers' parameters and Adam state,
  so the bytes held per rank are about 1/dp of the full state plus one buffer in flight.
  torch.distributed.checkpoint writes every key once, whichever rank has it, so the files are
  the same as from :meth:`state_dict`. Loading reverses it: each rank loads its keys from disk,
  then every buffer is broadcast from its owner over dp, one buffer at a time, and each rank keeps
  its own shard.

Both also hold the module's persistent buffers (the MoE layers' ``expert_bias``: model state that
is no parameter, :func:`module_buffers`) under their dense names on every rank, as a dense
``model.state_dict()`` does; they are replicated, so DCP writes each once, and loading copies them
back (``models.layout.load_buffers``; an older checkpoint without them: ``train.checkpoint.load``).

An asynchronous checkpoint (``checkpoint.async_save``) splits :meth:`ZeroStateMixin.checkpoint_state`
in two: :meth:`ZeroStateMixin.checkpoint_snapshot` copies this rank's shards (masters, Adam moments,
step counts, the optimizer's groups; the persistent buffers whole) into host buffers -- no
collective, the only part that blocks training -- and returns a function that the background
writer calls later with process groups of its own (the same ranks as the shard and tp groups, made
for checkpoints) to gather the copies into the same canonical state, so the gathers never
interleave with training's collectives.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.models.layout import load_buffers, persistent_buffers
from zerotron.parallel.tensor.layers import full_tensor, local_shard

_ADAM = ("exp_avg", "exp_avg_sq")


def snapshot_flats(flats: list, optimizer, buffers: dict | None = None) -> list[dict]:
    """Per flat buffer, host copies of this rank's shard: ``{"param", "exp_avg", "exp_avg_sq"
    (those the optimizer has), "step" (the state's scalar), "steps" (per-parameter counts or
    None)}``. No collective. ``buffers`` ({key: tensor}, kept by the caller): copies go into the
    buffers of the previous snapshot of the same shape (the caller must know it is no longer read)."""
    def copy(key, t):
        t = t.detach()
        buf = None if buffers is None else buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
            if buffers is not None:
                buffers[key] = buf
        return buf.copy_(t)

    out = []
    for i, f in enumerate(flats):
        st = optimizer.state.get(f.master, {}) if optimizer is not None else {}
        snap = {"param": copy(f"{i}/param", f.master), "steps": list(f.steps) if f.steps is not None else None,
                "step": st["step"].clone() if "step" in st else None}
        for key in _ADAM:
            if key in st:
                snap[key] = copy(f"{i}/{key}", st[key])
        f.release_disk()
        out.append(snap)
    return out


def gather_flats(flats: list, group, optimizer, owned, snaps: list | None = None, groups: dict | None = None
                 ) -> tuple[dict, dict]:
    """``({fqn: full-over-dp tensor (this rank's tp layout)}, {fqn: {"step", "exp_avg",
    "exp_avg_sq"}})`` of the flat buffers ``i`` with ``owned(i)``. Every buffer is all-gathered
    over its own shard group (``group``, or a buffer's sub-group of it: expert parameters, whose
    values are then this rank's expert range; collective, fixed order); only the owned ones are
    kept (one buffer in flight). ``snaps`` (:func:`snapshot_flats`): gather these copies instead of
    the live shards; ``groups`` ({id(group): stand-in group}): gather over the stand-ins (a
    background writer's own groups with the same ranks)."""
    vals, ostate = {}, {}
    for i, f in enumerate(flats):
        g = (groups or {}).get(id(f.group), f.group)
        live = snaps is None
        st = (optimizer.state.get(f.master, {}) if optimizer is not None else {}) if live else snaps[i]
        full = {"param": _gather_full(f.master.detach() if live else st["param"], g)}
        for key in _ADAM:
            if key in st:
                full[key] = _gather_full(st[key], g)
        if live:
            f.release_disk()  # the disk tier: the mapped state read for the gather leaves memory again
        if not owned(i):
            continue
        for j, (name, p, off, n) in enumerate(zip(f.names, f.params, f.offsets, f.numels)):
            vals[name] = full["param"][off:off + n].view(p.shape).clone()
            if live:
                step = f.param_step(j, st) if "exp_avg" in full else None
            else:
                step = (torch.tensor(float(st["steps"][j])) if st["steps"] is not None else st["step"].clone()) \
                    if "exp_avg" in full else None
            if step is not None and step > 0:  # never stepped (no gradient yet): no state, as in torch
                ostate[name] = {"step": step,
                                **{k: full[k][off:off + n].view(p.shape).clone() for k in _ADAM}}
    return vals, ostate


def _gather_full(shard: torch.Tensor, group) -> torch.Tensor:
    dt = torch.float64 if shard.dtype == torch.float64 else torch.float32
    out = torch.empty(shard.numel() * group.size(), dtype=dt, device=shard.device)
    comm.all_gather(out, shard.to(dt).contiguous(), group=group, async_op=True, tag="checkpoint").wait()
    return out


@torch.no_grad()
def load_flats_from_owners(flats: list, group, owner, params: dict, ostate: dict, optimizer) -> None:
    """Inverse of :func:`gather_flats` with a partition: the dp rank ``owner(i)`` holds the
    canonical tensors (this rank's tp layout) of flat buffer ``i`` in ``params`` / ``ostate``;
    it builds the padded vectors and broadcasts them over ``group``, one buffer at a time, and
    every rank keeps its shard (``FlatShard.load_flat``). ``optimizer`` None: parameters only.
    Parameters (compute copies) are not re-gathered. Collective."""
    rank, pg = group.rank(), comm._pg(group)
    with_state = optimizer is not None
    for i, f in enumerate(flats):
        dev, own = f.master.device, owner(i)
        if own == rank:
            flat, st, step = f.canonical_to_flat(params, ostate)
            flat, st = flat.to(dev), {k: v.to(dev) for k, v in st.items()}
            step_t = (step if step is not None else torch.zeros(len(f.params))).float().to(dev)
        else:
            flat = torch.empty(f.padded, dtype=f.master_dtype, device=dev)
            st = {k: torch.empty(f.padded, dtype=f.master_dtype, device=dev) for k in _ADAM}
            step_t = torch.empty(len(f.params), device=dev)
        src = dist.get_global_rank(pg, own) if pg is not None else own
        for t in [flat] + ([st[k] for k in _ADAM] + [step_t] if with_state else []):
            comm.broadcast(t, src=src, group=group, tag="checkpoint")
        f.load_flat(flat, st, step_t.cpu() if with_state else None, optimizer)


def module_buffers(module) -> dict:
    """``{fqn: detached tensor}`` of ``module``'s persistent buffers (``models.layout.persistent_buffers``):
    the canonical state's entries that are not in a flat buffer. Replicated on every rank (no
    strategy shards a buffer), so each rank hands all of them over and DCP writes each once."""
    return {k: v.detach() for k, v in persistent_buffers(module).items()}


def _flat_params(flats: list) -> dict:
    return {n: q for f in flats for n, q in zip(f.names, f.params)}


def canonical_flat_state(flats: list, group, tp_group, optimizer, owned, values: dict | None = None,
                         snaps: list | None = None, groups: dict | None = None, param_groups: list | None = None
                         ) -> tuple:
    """The one path from flat buffers to the canonical state, shared by ZeRO over the whole model
    (:class:`ZeroStateMixin`) and by the pipeline stages' ZeRO (``pipeline.state``).

    Returns ``({fqn: dense tensor}, {fqn: {"step", "exp_avg", "exp_avg_sq"}}, param_groups)`` for the
    flat buffers ``i`` with ``owned(i)``: :func:`gather_flats` over ``group`` (dp), then every
    tensor-parallel shard gathered to its dense tensor over ``tp_group`` (``full_tensor``, in the
    fixed flat order on every tp rank). ``values`` ({fqn: tensor, this rank's tp layout}) replaces
    the gather for parameters-only states whose compute copies are already full over dp.
    ``param_groups``: the optimizer's groups with the FQNs of every flat buffer (owned or not) in
    place of the master shards (``[]`` without an optimizer). Collective over dp (and tp).
    ``snaps``, ``groups``: see :func:`gather_flats` (``groups`` also stands in for ``tp_group``);
    ``param_groups``: the optimizer's groups as :func:`snapshot_param_groups` took them (with
    ``snaps``: the live ones may have changed since)."""
    if values is None:
        vals, ostate = gather_flats(flats, group, optimizer, owned, snaps, groups)
    else:
        vals, ostate = dict(values), {}
    if tp_group is not None:
        tp_group = (groups or {}).get(id(tp_group), tp_group)
        for name, q in _flat_params(flats).items():
            if name not in vals:  # not owned here (the same names on every tp peer)
                continue
            vals[name] = full_tensor(q, tp_group, local=vals[name])
            for k, v in ostate.get(name, {}).items():
                if v.dim() > 0:
                    ostate[name][k] = full_tensor(q, tp_group, local=v)
    return vals, ostate, snapshot_param_groups(flats, optimizer) if param_groups is None else param_groups


def snapshot_param_groups(flats: list, optimizer) -> list:
    """The optimizer's groups (hyper-parameters copied) with the FQNs of every flat buffer in place
    of the master shards (``[]`` without an optimizer)."""
    groups = []
    for g in optimizer.param_groups if optimizer is not None else []:
        names = [n for f in flats if any(f.master is q for q in g["params"]) for n in f.names]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return groups


@torch.no_grad()
def load_flat_state(flats: list, group, tp_group, msd: dict, osd: dict | None, optimizer, owner=None) -> None:
    """Inverse of :func:`canonical_flat_state`: dense canonical tensors (names of other stages are
    ignored) sliced to this rank's tensor-parallel shards, then either every rank takes its dp shard
    (``owner`` None: ``msd`` holds every flat name) or dp rank ``owner(i)`` broadcasts flat buffer
    ``i`` (:func:`load_flats_from_owners`); stages 1-2 re-gather their full compute parameters, and
    each optimizer group takes the saved learning rate. ``optimizer`` None: parameters only.
    Collective over dp."""
    osd = osd if osd is not None else {"state": {}, "param_groups": []}
    params = _flat_params(flats)

    def local(name, t):
        return t if tp_group is None else local_shard(params[name], t, tp_group)

    dense = {n: local(n, t) for n, t in msd.items() if n in params}
    ostate = {n: {k: local(n, v) for k, v in st.items()} for n, st in osd["state"].items() if n in params}
    if owner is None:
        for f in flats:
            f.load_canonical(dense, ostate, optimizer)
    else:
        load_flats_from_owners(flats, group, owner, dense, ostate, optimizer)
    regather = [f for f in flats if f.stage < 3]  # stage 3 gathers on use
    for f in regather:
        f.launch_gather()
    for f in regather:
        f.wait_gather()
    for g, saved in zip(optimizer.param_groups if optimizer is not None else [], osd.get("param_groups", [])):
        g["lr"] = saved.get("lr", g["lr"])


class ZeroStateMixin:
    """``state_dict`` / ``load_state_dict`` / ``checkpoint_state`` / ``load_checkpoint_state`` for
    ``ZeroStrategy`` (attributes used: ``all_flats``, ``group``, ``tp_group``)."""

    def _owner(self, i: int) -> int:
        """dp rank that writes and reads flat buffer ``i`` in a checkpoint."""
        return i % self.group.size()

    def _canonical(self, optimizer, owned, buffers: dict | None = None, **snapshot) -> tuple[dict, dict]:
        if not snapshot:
            self.settle()  # offload: nothing of the last step still in flight
        msd, osd_state, groups = canonical_flat_state(self.all_flats, self.group, self.tp_group, optimizer, owned,
                                                      **snapshot)
        for alias, owner in self.module.layout().tied:  # tied entries, as in the dense state dict
            if owner in msd:
                msd[alias] = msd[owner]
        # the persistent buffers (MoE expert_bias), replicated: every rank hands them over, DCP writes each once
        msd.update(module_buffers(self.module) if buffers is None else buffers)
        return msd, {"state": osd_state, "param_groups": groups}

    def state_dict(self, optimizer=None):
        """Full, unsharded state in the format of ``get_state_dict(plain_model, AdamW)``, gathered
        from the shards on every rank (transiently materialises the full model and optimizer
        state). Collective over dp (and tp)."""
        return self._canonical(optimizer, lambda i: True)

    def checkpoint_state(self, optimizer=None):
        """The canonical state of the flat buffers this dp rank owns (module docstring): keys are a
        1/dp share of :meth:`state_dict`'s; ``param_groups`` list every name. Collective."""
        rank = self.group.rank()
        return self._canonical(optimizer, lambda i: self._owner(i) == rank)

    def checkpoint_groups(self) -> list:
        """The groups :meth:`checkpoint_state` gathers over (the shard groups of the flat buffers
        and the tp group): a background writer makes stand-ins with the same ranks."""
        return list({id(g): g for g in [f.group for f in self.all_flats] + [self.tp_group] if g is not None}.values())

    def checkpoint_snapshot(self, optimizer, buffers: dict | None = None):
        """:meth:`checkpoint_state` in two halves (module docstring): host copies of this rank's
        shards now (:func:`snapshot_flats`, into ``buffers``; no collective), and the returned
        function ``finish(groups)`` ({id(group): stand-in} for :meth:`checkpoint_groups`) that
        gathers them later, collectively over the stand-ins, into what :meth:`checkpoint_state`
        would have returned at the snapshot."""
        self.settle()
        snaps = snapshot_flats(self.all_flats, optimizer, buffers)
        param_groups = snapshot_param_groups(self.all_flats, optimizer)
        bufs = {k: v.to("cpu", copy=True) for k, v in module_buffers(self.module).items()}  # training moves them
        rank = self.group.rank()

        def finish(groups: dict) -> tuple[dict, dict]:
            return self._canonical(optimizer, lambda i: self._owner(i) == rank, bufs, snaps=snaps, groups=groups,
                                   param_groups=param_groups)
        return finish

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Take this rank's shards out of a full canonical state (any dp degree / stage saved it)."""
        self.settle()
        load_flat_state(self.all_flats, self.group, self.tp_group, msd, osd, optimizer)
        load_buffers(self.module, msd)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load what :meth:`checkpoint_state` described (each rank holds its owned buffers' keys,
        read from disk): every buffer is broadcast from its owner over dp, one at a time, and each
        rank keeps its shard. ``optimizer`` None loads the parameters only. Collective."""
        self.settle()
        load_flat_state(self.all_flats, self.group, self.tp_group, msd, osd, optimizer, self._owner)
        load_buffers(self.module, msd)  # replicated: every rank read them
