"""Checkpoint state of a pipeline rank: the canonical dense, FQN-keyed format shared by every
layout (tensor-parallel shards gathered, ZeRO-1 shards gathered, the tied copy keyed like the dense
model), and ``full_params`` (the dense model assembled from every stage). Mixed into
``pipeline.PipelineStrategy``."""
from __future__ import annotations

import contextlib

import torch

from zerotron.distributed import comm
from zerotron.models.deferred import release_params, restore_params
from zerotron.models.layout import get_module, load_buffers, retie
from zerotron.parallel.data.zero_state import canonical_flat_state, load_flat_state
from zerotron.parallel.precision import upcast
from zerotron.parallel.tensor.transform import tp_state_dict_full


class PipelineStateMixin:
    """``state_dict`` / ``load_state_dict`` / ``full_params`` for :class:`PipelineStrategy`."""

    def state_dict(self, optimizer=None):
        """Canonical ``(model_state, optimizer_state)`` of this rank's stages (FQN-keyed, as
        ``get_state_dict`` gives for the dense model). The optimizer's ``param_groups`` (a non-tensor
        entry that DCP stores from ONE rank) are made identical on every rank: each group lists the
        FQNs of the whole model (union over the pp group, tied weight once under its
        owner's name), exactly like the dense model's. Collective over pp; over tp
        (tensor parallel: shards gathered to dense tensors) and dp (ZeRO-1: shards gathered)."""
        return self._canonical(optimizer, None)

    def checkpoint_state(self, optimizer=None):
        """What this rank hands to DCP: :meth:`state_dict`, except that with ZeRO-1 each dp rank
        keeps only the flat buffers it owns (buffer i -> dp rank i mod dp), so the Adam state is
        never held in full (not with expert parallelism: the ep ranks of an expert buffer would own
        different keys; every rank then hands over the whole state, DCP writes each key once).
        Collective over pp, dp (and tp, ep)."""
        if self.zero is None or self.experts is not None:
            return self.state_dict(optimizer)
        rank, n = self.zero.group.rank(), self.zero.group.size()
        return self._canonical(optimizer, lambda i: i % n == rank)

    def load_checkpoint_state(self, msd, osd, optimizer=None) -> None:
        """Load what DCP filled into :meth:`checkpoint_state`'s dicts (ZeRO-1: broadcast from the
        owners). Collective."""
        if self.zero is None or self.experts is not None:
            return self.load_state_dict(msd, osd, optimizer)
        n = self.zero.group.size()
        load_flat_state(self.zero.all_flats, self.zero.group, self.tp_group, msd, osd, optimizer, lambda i: i % n)
        load_buffers(self.module, msd)  # the persistent buffers (saved by _zero_state_dict, every rank read them)

    def _canonical(self, optimizer, owned):
        if self.zero is not None:
            msd, osd = self._zero_state_dict(optimizer, owned)
        elif self.fsdp2 is not None:  # FSDP2's full state dict (gathered over dp, then tp)
            msd, osd = self.fsdp2.fsdp.state_dict(optimizer)
        else:
            msd, osd = super().state_dict(optimizer)
        if self.experts is not None:  # this ep rank's expert range -> the full tensors
            msd, osd = self.experts.gather_entries(msd, osd)
        if osd is not None:
            everyone = comm.all_gather_object([g["params"] for g in osd["param_groups"]], group=self.pp_group)
            for i, g in enumerate(osd["param_groups"]):
                names = [n for lists in everyone for n in lists[i]]
                g["params"] = list(dict.fromkeys(names))
        return msd, osd

    def _zero_state_dict(self, optimizer, owned=None):
        """ZeRO: canonical (dense) state of the stage's flat shards (``zero_state.canonical_flat_state``,
        the path ZeRO over the whole model takes too), keyed like this stage's ``state_dict``
        (buffers and the tied copy included). With ``owned`` (flat index -> bool) only those
        buffers' parameters and state are returned."""
        z = self.zero
        values = None
        if optimizer is None and z.stage < 3:  # parameters only: the compute copies are full over dp
            values = {n: upcast(q.detach()) for f in z.all_flats for n, q in zip(f.names, f.params)}
        by_name, ostate, groups = canonical_flat_state(z.all_flats, z.group, self.tp_group, optimizer,
                                                       owned or (lambda i: True), values)
        name_of = {id(q): n for f in z.all_flats for n, q in zip(f.names, f.params)}
        msd = {key: by_name[name_of[id(t)]] if id(t) in name_of else t.detach()
               for key, t in self.module.state_dict(keep_vars=True).items()
               if id(t) not in name_of or name_of[id(t)] in by_name}
        if optimizer is None:
            return msd, None
        return msd, {"state": ostate, "param_groups": groups}

    def load_state_dict(self, msd, osd, optimizer=None) -> None:
        """Load a canonical state (from ``state_dict`` of any layout: pp, tp, dp, ZeRO) into this
        rank's stages: dense tensors sliced to tp shards (``shard_tensor``), ZeRO dp shards taken
        out of the flat buffers (``zero_state.load_flat_state``); expert tensors cut to this ep rank's range."""
        if self.experts is not None:
            msd, osd = self.experts.slice_entries(msd, osd)
        if self.fsdp2 is not None:
            return self.fsdp2.fsdp.load_state_dict(msd, osd, optimizer)
        if self.zero is None:
            return super().load_state_dict(msd, osd, optimizer)
        load_flat_state(self.zero.all_flats, self.zero.group, self.tp_group, msd, osd, optimizer)
        load_buffers(self.module, msd)

    @contextlib.contextmanager
    def full_params(self):
        """Collective over the pp group (every pp rank must enter): broadcast each model stage's
        parameters from the pp rank that owns it into the model given at construction and yield
        it (evaluation, generation, export). Its stage parameters are this rank's own
        Parameters, so use it read-only; the other stages' parameters have memory only while the
        context is open (meta tensors again on exit, ``models.deferred.release_params``). Tensor parallel: also collective over tp --
        the gathered TP model's shards are assembled (``tp_state_dict_full``) into a dense model
        (built once, kept, refreshed on every call), which is yielded instead."""
        with contextlib.ExitStack() as stack:
            if self.zero is not None:  # ZeRO-3: this rank's stage parameters gathered for the context
                stack.enter_context(self.zero.full_params())
            if self.fsdp2 is not None:  # FSDP2: every unit unsharded (plain parameters on the modules)
                stack.enter_context(self.fsdp2.gathered())
            experts = contextlib.ExitStack()
            try:
                if self.pp > 1:
                    restore_params(self._foreign)  # memory again (contents arrive by broadcast)
                    lay, seen = self.dense.layout(), set()
                    blocks = get_module(self.dense, lay.blocks)
                    with torch.no_grad():
                        for s, layers in enumerate(self.module.layer_ranges):
                            mods = [blocks[i] for i in layers]
                            mods += [get_module(self.dense, m) for m in lay.embedding] if s == 0 else []
                            mods += [get_module(self.dense, m) for m in lay.head] if s == self.module.last_stage else []
                            qs = []
                            for mod in mods:
                                for q in mod.parameters():
                                    if id(q) in seen:  # a tied parameter: sent once, by stage 0's owner
                                        continue
                                    seen.add(id(q))
                                    if q.dtype != self.executor.act_dtype:  # ZeRO bf16: stages hold bf16 copies
                                        q.data = q.data.to(self.executor.act_dtype)
                                    qs.append(q.data)
                            # the stage's parameters in one broadcast from the pp rank that owns it
                            comm.broadcast_coalesced(qs, src=self._peer(self.placement.rank_of(s)), group=self.pp_group,
                                                     tag="full_params")
                if self.experts is not None:  # every expert gathered over ep, the local dispatch
                    experts.enter_context(self.experts.full_model(self.dense))
                if self.tp_group is None:
                    yield self.dense
                    return
                sd = tp_state_dict_full(self.dense)  # collective over tp, fixed key order
                if self._dense_copy is None:
                    with torch.device("meta"):  # no RNG draw, no init cost
                        g = type(self.dense)(self.dense.config)
                    w = next(iter(sd.values()))
                    g = g.to_empty(device=w.device).to(w.dtype)  # the training dtype (fp64 mode: float64)
                    retie(g, g.layout())  # to_empty makes new Parameters
                    g.init_buffers()  # non-persistent buffers (e.g. RoPE tables) are not in sd
                    self._dense_copy = g
                with torch.no_grad():
                    self._dense_copy.load_state_dict(sd)
                self._dense_copy.train(self.dense.training)
                yield self._dense_copy
            finally:
                experts.close()  # the shards back before their memory is released
                release_params(self._foreign)

    # ---- forward only ------------------------------------------------------------------------
