"""ZeRO stage 1 for one pipeline rank's stages (pipeline x ZeRO-1 over dp); see :class:`StageZero1`."""
from __future__ import annotations

import contextlib

import torch

from zerotron.distributed import comm
from zerotron.parallel import precision
from zerotron.parallel.base import unique_params
from zerotron.parallel.data.flat_shard import FlatShard
from zerotron.parallel.data.zero_state import gather_flats, load_flats_from_owners
from zerotron.parallel.tensor.layers import is_tp_sharded

__all__ = ["StageZero1"]


class StageZero1:
    """ZeRO stage 1 over the dp group for the parameters of one pipeline rank's stages
    (Rajbhandari et al. 2020), built from ``zero.FlatShard``.

    Units: the tied embedding/head weight alone (so the first and the last stage hold it in flat
    buffers of the same layout and reduce it with the same arithmetic: the copies stay bitwise
    equal), the other non-block parameters (e.g. position embeddings and final norm), then each block; inside a unit one flat
    buffer per (weight decay, tp-sharded) pair. Gradients accumulate in full locally (``param.grad``
    are views into each flat's ``grad_full``) over every micro-batch and flush; ``finish_grads``
    reduce-scatters every flat buffer over dp, then sums the tied shard over ``tied_group`` (and,
    with sequence parallelism, the tp-replicated shards over tp), every sum in ``reduce_dtype``;
    AdamW steps the fp32 master shards; ``gather_params`` all-gathers the updated parameters.

    Args: ``module`` (a StageModel), ``group`` (dp NamedGroup), ``mask`` (decay flag by
    ``id(param)``), ``tied`` (this rank's tied Parameter or None), ``dtype``/``reduce_dtype``
    (see ``parallel.precision``). Attributes: ``all_flats`` (list of FlatShard; each has ``tp_sharded`` and
    ``is_tied``), ``group``."""

    def __init__(self, module, group, mask: dict, tied=None, dtype: str = "fp32", reduce_dtype: str = "auto"):
        compute, reduce = precision.compute_dtype(dtype), precision.reduce_dtype(dtype, reduce_dtype)

        self.group, self.tied = group, tied
        names = {}
        for n, q in module.named_parameters():  # first FQN of each (tied) parameter
            names.setdefault(id(q), n)
        blocks = list(module.blocks_here.values())
        in_block = {id(q) for b in blocks for q in b.parameters()}
        root = [q for q in unique_params(module) if id(q) not in in_block and q is not tied]
        units = ([[tied]] if tied is not None else []) + [root] + [unique_params(b) for b in blocks]
        self.all_flats = []
        with torch.no_grad():
            for params in units:
                for decay in (True, False):
                    for sharded in (True, False):  # tp-sharded and tp-replicated kept apart
                        ps = [q for q in params if mask.get(id(q), False) == decay and is_tp_sharded(q) == sharded]
                        if ps:
                            f = FlatShard([names[id(q)] for q in ps], ps, decay, 1, group, compute, reduce)
                            f.tp_sharded, f.is_tied = sharded, ps[0] is tied
                            self.all_flats.append(f)

    def no_sync(self):
        """Nothing is communicated during backward: every micro-batch only accumulates."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for f in self.all_flats:
            f.grad_full.zero_()
            f.shard_grad.zero_()
            f.master.grad = None
            f.attach_grad_views()

    def finish_grads(self, tied_group=None, tp_group=None) -> None:
        """Reduce-scatter every flat gradient over dp (in ``reduce_dtype``), then sum the tied
        shard over ``tied_group`` (first and last pipeline rank of this (dp, tp) coordinate: same
        flat layout, same dp shard; the sums commute) and, when ``tp_group`` is given (sequence
        parallel), the tp-replicated shards over tp (same layout on every tp rank). Both sums run
        on the fp32 shard gradients in ``reduce_dtype`` (``comm.all_reduce_in``) -- summing the
        compute-dtype (bf16) ``grad_full`` instead would ignore an fp32 reduce dtype. Exposes the
        fp32 shard gradients as ``master.grad``."""
        for f in self.all_flats:
            f.launch_reduce()
        for f in self.all_flats:
            f.wait_reduce()
        if tied_group is not None:
            for f in self.all_flats:
                if f.is_tied:
                    comm.all_reduce_in(f.shard_grad, f.reduce_dtype, group=tied_group, tag="pp_tied")
        if tp_group is not None:
            for f in self.all_flats:
                if not f.tp_sharded:
                    comm.all_reduce_in(f.shard_grad, f.reduce_dtype, group=tp_group, tag="tp_grad")
        for f in self.all_flats:
            f.master.grad = f.shard_grad

    def gather_params(self) -> None:
        """All-gather the updated master shards into the full compute parameters (after step)."""
        with torch.no_grad():
            for f in self.all_flats:
                f.launch_gather()
            for f in self.all_flats:
                f.wait_gather()

    def full_state(self, optimizer, owned=None) -> tuple[dict, dict]:
        """``({id(param): tensor}, {fqn: adam state})`` of this rank's parameters, unsharded over dp
        (still tp shards), for the flat buffers ``i`` with ``owned(i)`` (default all). Collective
        over dp, flat buffers in a fixed order."""
        by_name, ostate = gather_flats(self.all_flats, self.group, optimizer, owned or (lambda i: True))
        ids = {n: id(q) for f in self.all_flats for n, q in zip(f.names, f.params)}
        return {ids[n]: t for n, t in by_name.items()}, ostate

    @torch.no_grad()
    def load_full_state(self, params: dict, ostate: dict, optimizer) -> None:
        """Inverse of :meth:`full_state`: ``params`` {fqn: tensor in this rank's tp layout} (every
        flat name needed), ``ostate`` {fqn: {"step", "exp_avg", "exp_avg_sq"}} (may be empty).
        Takes this rank's dp shard of each flat buffer, then all-gathers the parameters."""
        for f in self.all_flats:
            f.load_canonical(params, ostate, optimizer)
        self.gather_params()

    @torch.no_grad()
    def load_from_owners(self, params: dict, ostate: dict, optimizer, owner) -> None:
        """Like :meth:`load_full_state`, but dp rank ``owner(i)`` alone holds flat buffer ``i``'s
        tensors and broadcasts them (``zero_state.load_flats_from_owners``). Collective over dp."""
        load_flats_from_owners(self.all_flats, self.group, owner, params, ostate, optimizer)
        self.gather_params()
