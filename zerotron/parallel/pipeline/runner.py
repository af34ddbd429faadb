"""Pipeline parallelism over the mesh's "pp" dimension: stage split, schedules, tied weights.

``PipelineStrategy(model, mesh, plan)`` splits a fully initialised ``CausalLM`` (identical on every rank)
into ``pp * v`` model stages (v = ``parallel.virtual_stages`` for "interleaved" and "zb-v", else 1); pipeline
rank r holds the stages ``c*pp + r`` for its chunks c (Megatron-LM interleaving). Layers per
stage follow ``parallel.pp_split``: "auto" (default; balanced over FLOP estimates that count the
embedding on stage 0 and the head + loss on the last stage, ``pipeline.balance``; the same
min-max partition over the pp*v model stages when interleaved), "even" (equal counts, earlier
stages take the remainder) or explicit counts; with "auto" rank 0 prints the chosen split once. Model stage 0
also holds the layout's embedding modules, the last one its head modules (``model.layout()``).

Schedules (``parallel.pp_schedule``, built by ``schedules.build_schedule`` and walked by
``pipeline.executor.PipelineExecutor``): "naive" (model parallel: each flush's micro-batches
concatenated into one batch, one stage busy at a time), "gpipe" (Huang et al. 2019), "1f1b"
(PipeDream-Flush, Narayanan et al. 2021), "interleaved" (Megatron-LM, Narayanan et al. 2021),
"zb-h1" (Qi et al. 2024, zero bubble: each backward split into B, the input gradient, and W, the
weight gradients, run later; ``pipeline.split_backward``), "zb-v" (Qi et al. 2024, ZB-V: the same split
backward over two model stages per rank placed in a V, rank r holding stages r and 2pp-1-r, so rank 0
has both the embedding and the head and the tied weight needs no cross-rank sum; gloo only). Gradient synchronisers see W as the
backward: DDP's last-flush buckets fire in the last micro-batch's W, ZeRO-2/3 reduce-scatter after
each W (ZeRO-3 gathers the stage's blocks for it: recomputation and saved tensors read them).

Step structure: the trainer hands this rank its M micro-batches; ``m = parallel.microbatches or M``
per pipeline flush, M/m flushes (outer gradient accumulation, no rescaling). Gradients are summed
over dp by an inner ``DataParallel`` whose hooks fire inside the pipeline backward, only in the last
flush (and only on each chunk's last backward); ``finish_grads`` waits for it and then sums the tied
embedding/head gradients between the first and last pipeline rank. With ``parallel.dp_impl = torch``
(``plan.sync == "torch_ddp"``) each local chunk gets its own torch DDP instead
(``pipeline.stage_sync.StageTorchDDP``: no_sync before, the reducer armed before the chunk's last backward);
with ``parallel.zero_impl = fsdp2`` (ZeRO-2/3) FSDP2 shards each local block and one root of the rank's
other modules over dp (``pipeline.stage_sync.StageFSDP2``: gradients accumulate unsharded over the step,
one reduce-scatter per unit after the last backward; the tied copies are sharded alike on the first and
last rank, so ``finish_grads`` sums their local shards over the tied group).

Tied weights (the layout's ``tied`` pair, e.g. a head tied to the token embedding):
the first stage owns the parameter; the last stage holds its own copy, registered like the dense
model does under both names (the owner's module comes along). Their gradients are summed before
every optimizer step (group "pp_tied") and the gradient norm counts the tied weight once, so the
copies stay bitwise equal. Optimizer-state key choice: the dense model's AdamW state for the tied
weight is keyed by the owner name (``named_parameters`` de-duplicates to the first name); both
pipeline copies use that same key (identical values, DCP
stores it once), and ``state_dict`` lists the whole model's FQNs in every ``param_groups`` entry, so
checkpoints reshard between pp=1 and any pp (tested pp 1 <-> 2 -> 4).

3-D layouts (pp x dp x tp):
  * tensor parallel: ``parallelize`` applies ``tensor.transform.apply_tensor_parallel`` (no sequence
    parallel) to the dense model first and splits the TP model; every tp rank of a pipeline stage
    runs its shards, the p2p activations (b, T, C) are full and identical across the tp ranks, and
    each tp rank talks to the same tp rank of the neighbouring stage (the peer map keeps dp, tp).
    The last stage's loss is the vocab-parallel cross-entropy (``tensor.transform.tp_loss_sum``); the tied
    gradient sum runs per (dp, tp) coordinate (both copies are the same vocabulary shard); the
    norm sums squares of tp-sharded gradients over tp, counts tp-replicated ones once, and sums
    over pp; checkpoints are gathered to the dense canonical format (``full_tensor``, collective
    over tp in the fixed state-dict order) and sliced again on load (``shard_tensor``).
  * ZeRO over dp (``parallel.zero_stage = 1, 2, 3``): the inner DataParallel is replaced by the
    same native ZeRO driver the plain runner uses (``data.zero.ZeroSync``) over this rank's stages
    (units: the tied weight alone, the other non-block parameters, each block): ZeRO-1 accumulates
    full gradients locally over all flushes and reduce-scatters each flat buffer in finish_grads;
    ZeRO-2/3 reduce-scatter the units of the chunk a backward action (one micro-batch through one
    chunk, or its W) ran right after it and free the gradients; ZeRO-3 also keeps parameters
    sharded at rest, gathering blocks around their forward and backward (and for a W) and the root
    units for the step. Then HSDP (``parallel.dp_replicate > 1``: sharded over the shard group,
    shard gradients all-reduced across the replicas), the tied gradient shard summed between the
    first and last stage, AdamW on the fp32 master shards (per parameter for partly used buffers),
    one all-gather of the updated parameters. Sequence parallelism: stage boundaries carry (b, T/tp,
    C) shards, and finish_grads sums the replicated parameters' gradients over tp (ZeRO: their dp
    shards, in ``parallel.reduce_dtype``).

Expert parallelism (``parallel.ep > 1``): every block's experts are sharded over ep before the
split (``parallel.expert.stages.StageExperts``: ep groups carved out of each stage's batch group dp x cp, so the ranks
of one ep group hold the same stage and walk the same action list; their all-to-alls meet in F, in B,
and in W where W is the whole backward of model stage 0; the expert weight gradients of a W are local
matmuls). DDP leaves the expert shards out of its buckets and sums their flat gradient buffer over
the replica group dp/ep in ``finish_grads``; ZeRO shards their flat buffers over that group
(``ZeroSync``'s ``group_of``); the norm sums the expert shards' squares over ep; the canonical state
gathers them over ep. The auxiliary losses need no path across stages: each MoE layer injects its
own into its output's backward, weighted per micro-batch (``models.mixtral``).

Also: ``last_step_timing()`` (measured busy/idle per rank), ``full_params()`` (the dense model with
every stage's weights broadcast in; collective over pp -- and over tp, which yields a separate
dense model rebuilt from the gathered shards), ``pipeline.generate.pipeline_generate`` (greedy decoding).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.models.deferred import finish, is_deferred, release_params
from zerotron.models.layout import get_module
from zerotron.parallel.base import IGNORE_INDEX, Strategy, autocast_ctx, unique_params
from zerotron.parallel.data.ddp import DataParallel
from zerotron.parallel.data.hsdp import ddp_hierarchy
from zerotron.parallel.data.zero import ZeroSync
from zerotron.parallel.expert.stages import StageExperts
from zerotron.parallel.grad_norm import clip_grad_norm
from zerotron.parallel.optim import build_optimizer, decay_mask
from zerotron.parallel.pipeline.balance import announce_split, resolve_split
from zerotron.parallel.pipeline.executor import (
    PipelineExecutor,
    StageModel,
    forward_only_actions,
    stage_layer_counts,
    stage_layer_ranges,
)
from zerotron.parallel.pipeline.schedules import build_schedule
from zerotron.parallel.pipeline.stage_sync import StageFSDP2, StageTorchDDP
from zerotron.parallel.pipeline.state import PipelineStateMixin
from zerotron.parallel.tensor.layers import is_tp_sharded
from zerotron.parallel.tensor.transform import sync_replicated_grads

__all__ = ["PipelineStrategy", "StageModel", "stage_layer_counts",
           "stage_layer_ranges"]


class PipelineStrategy(PipelineStateMixin, Strategy):
    """Pipeline (x data) parallel strategy; see the module docstring.

    Args: ``model`` (a fully initialised ``CausalLM``, identical on all ranks, or the tensor-parallel
    model made from it; afterwards use ``.module``; with pp > 1 the parameters of other ranks' stages
    are left without memory (``models.deferred.release_params``: meta tensors, identity, shape and
    dtype kept; ``released_bytes``; ``full_params`` gives them memory for the duration of its
    context), so parameter memory falls with pp), ``mesh``, ``plan`` (a
    ``zerotron.plan.ParallelPlan``, already validated: pp_schedule, microbatches, virtual_stages,
    pp_split, bucket_mb, zero_stage, reduce_dtype, dtype, activation_checkpointing),
    ``mask`` (weight-decay flag by ``id(param)`` of ``model``; default ``optim.decay_mask(model)``,
    only used by ZeRO-1, which fixes the flag per flat buffer at construction).
    Attributes: ``module`` (this rank's ``StageModel``), ``ddp`` (inner DataParallel over dp, or
    None with ZeRO-1), ``zero`` (the ZeRO driver ``data.zero.ZeroSync`` over this rank's stages, or None), ``tp_group`` (the tp NamedGroup when
    ``model`` is tensor-parallel, else None), ``loss_groups`` = [pp group, batch group] (``dp_group`` is the batch group dp x cp: under context
    parallelism each stage's gradients are summed, and ZeRO/FSDP2 shard, over it). Raises
    ValueError for a pp_split the model cannot take or a layout with more than one tied pair (the
    rest of the layout rules are the plan's)."""

    def __init__(self, model, mesh, plan, mask: dict | None = None):
        p = self.plan = plan
        self.kind, self.microbatches = p.pp_schedule, p.microbatches
        self.placement = place = p.placement  # which rank holds which model stage (loop, or zb-v's V)
        self.v = place.v  # model stages per rank: virtual_stages when chunked
        self.mesh, self.pp, self.rank = mesh, mesh.size("pp"), mesh.local_rank("pp")
        n_stages = place.n_stages
        recompute = p.activation_checkpointing
        self.split = resolve_split(model, n_stages, p.pp_split, recompute, place)  # layers per model stage
        ranges = stage_layer_ranges(self.split)
        if mesh.rank == 0 and p.pp_split.strip() == "auto":
            announce_split(model, self.split, p.pp_split, recompute, place)
        self.experts, before = None, dict(model.named_parameters())
        if p.ep > 1:  # every block's experts sharded over ep before the split (parallel.expert.stages)
            self.experts = StageExperts(model, mesh.group("batch"), p.ep, mesh.dims.group_ranks("batch"))
        self.dense = model
        self._dense_copy = None  # dense model rebuilt by full_params() for tensor-parallel models
        self.module = StageModel(model, place.stages(self.rank), ranges)
        if is_deferred(model):  # meta-device model: storage and dense values for this rank's stages only
            own = {id(q) for q in self.module.parameters()}
            release_params([q for q in model.parameters() if id(q) not in own])  # they stay on meta
            if p.sync not in ("zero", "fsdp2"):  # ZeRO and FSDP2 materialise unit by unit (parallelize finishes)
                finish(model)
        self.last_rank = place.last_rank  # pp index of the last model stage
        self.tp_group = self.module.tp_group
        self._peer = lambda q: mesh.peer(pp=q)  # pp index -> global rank (same dp, cp, tp)
        self._schedules: dict = {}
        # the batch group dp x cp (= dp without context parallelism): every rank of a stage holding a
        # different part of the global batch's tokens; gradients are summed, ZeRO/FSDP shard, over it
        self.pp_group, self.dp_group = mesh.group("pp"), mesh.group("batch")
        self.loss_groups = [self.pp_group, self.dp_group]
        self.first, self.last = self.module.holds(0), self.module.holds(n_stages - 1)
        expert_ids = self.experts.keep(self.module) if self.experts is not None else frozenset()
        lay = model.layout()
        if len(lay.tied) > 1:
            raise ValueError(f"pipeline parallelism supports at most one tied parameter pair, the layout has "
                             f"{len(lay.tied)}: {list(lay.tied)}")
        self.tied = None  # the parameter shared by stage 0 and the last stage (e.g. tied embedding/head)
        if lay.tied and (self.first or self.last):
            owner = lay.tied[0][1].rpartition(".")
            self.tied = getattr(get_module(self.module, owner[0]), owner[2])
        self.tied_group = None
        if self.last_rank != 0 and lay.tied:  # one {pp-first, pp-last} group per pipeline, made everywhere
            lines = mesh.dims.group_ranks("pp")  # the ranks of one pipeline, by stage
            if len(lines[0]) == 2:  # two pp ranks: the pp group is that pair (no new group, no more gloo threads)
                if self.first or self.last:
                    self.tied_group = comm.NamedGroup(self.pp_group.pg, "pp_tied")
            else:
                for line in lines:
                    pg = dist.new_group([line[0], line[self.last_rank]])
                    if mesh.rank in line and (self.first or self.last):
                        self.tied_group = comm.NamedGroup(pg, "pp_tied")
        self.ddp = self.zero = self.stage_sync = self.fsdp2 = None
        if p.sync == "torch_ddp":  # torch's wrappers per stage chunk (pipeline.stage_sync)
            self.stage_sync = StageTorchDDP(self.module, self.dp_group, p.bucket_mb, p.find_unused_parameters)
        elif p.sync == "fsdp2":  # fully_shard per block and one root per rank (pipeline.stage_sync)
            self.stage_sync = self.fsdp2 = StageFSDP2(self.module, mesh, p.zero_stage, p.dtype, p.reduce_dtype,
                                                          offload=p.offload == "params")
            if self.tied is not None:  # fully_shard registered a new (DTensor) parameter
                self.tied = getattr(get_module(self.module, owner[0]), owner[2])
        elif p.zero_stage:
            mask = mask if mask is not None else decay_mask(model)
            if self.experts is not None:  # the expert shards are new Parameters: the dense ones' flags
                mask = self.experts.decay_flags(mask, before)
            self.zero = self._zero_sync(mesh, mask)
        else:
            self.ddp = DataParallel(self.module, self.dp_group, bucket_mb=p.bucket_mb, src_rank=mesh.peer(dp=0, cp=0),
                                    exclude=expert_ids, **ddp_hierarchy(mesh))  # HSDP: hierarchical all-reduce per bucket
            if self.experts is not None:  # one flat gradient buffer, summed over the replicas in finish_grads
                self.experts.attach_grads()
        self.inner = next(x for x in (self.zero, self.stage_sync, self.ddp) if x is not None)  # no_sync / zero_grad
        act_dtype = getattr(self.stage_sync, "act_dtype", None) or next(iter(self.module.parameters())).dtype
        self.executor = PipelineExecutor(self.module, self.pp_group, place, self.rank, self._peer, act_dtype)
        if self.stage_sync is not None:
            self.executor.forward_chunk = self.stage_sync.forward
        self._timing = {"busy_s": 0.0, "idle_s": 0.0, "bubble_fraction": 0.0}
        own = {id(q) for q in self.module.parameters()}  # other stages' parameters: no memory (meta)
        self._foreign = [q for q in model.parameters() if id(q) not in own] if self.pp > 1 else []
        self.released_bytes = release_params(self._foreign)

    def _zero_sync(self, mesh, mask: dict) -> ZeroSync:
        """The native ZeRO driver over this rank's stages, as the plain runner's over the whole
        model (same shard / replicate groups, HSDP included). Units: the tied weight alone (so the
        first and the last stage hold it in flat buffers of the same layout and reduce it with the
        same arithmetic: the copies stay bitwise equal), the other non-block parameters, then each
        block; ``self._chunk_units[c]``: the units a backward of chunk c produces gradients for."""
        names = {}
        for n, q in self.module.named_parameters():  # first FQN of each (tied) parameter
            names.setdefault(id(q), n)
        blocks = list(self.module.blocks_here.items())  # (global block index, module), chunk by chunk
        in_block = {id(q) for _, b in blocks for q in b.parameters()}
        root = [q for q in unique_params(self.module) if id(q) not in in_block and q is not self.tied]
        roots = ([[self.tied]] if self.tied is not None else []) + [root]
        units = roots + [unique_params(b) for _, b in blocks]
        ends = (0, self.module.last_stage)  # stages that run root modules (embedding, head)
        self._chunk_units = [
            [u for u, (i, _) in enumerate(blocks, start=len(roots)) if int(i) in self.module.layer_ranges[s]]
            + (list(range(len(roots))) if s in ends else []) for s in self.module.stages]
        mask = dict(mask)
        if self.tied is not None:
            mask[id(self.tied)] = False  # an embedding: never decayed
        p, sp = self.plan, self.module.sequence_parallel
        group_of = ({id(q): self.experts.rep_group for q in self.experts.expert_params.values()}
                    if self.experts is not None else None)  # expert shards: sharded over dp/ep
        return ZeroSync(units, names, mask, mesh.group("shard"), p.zero_stage, p.dtype, p.reduce_dtype,
                        n_root=len(roots), blocks=[b for _, b in blocks], tp_group=self.tp_group,
                        sequence_parallel=sp, replicate_group=mesh.group("dp_rep"), dp_group=self.dp_group,
                        tied=self.tied, tied_group=self.tied_group, count_tied=self.first or not self.last,
                        eager=False, offload=p.offload, offload_dir=p.offload_dir, group_of=group_of)

    # ---- structure ---------------------------------------------------------------------------
    def stage_modules(self) -> dict[int, list[str]]:
        """{model stage: names of the modules it runs} for this rank's stages: the layout's embedding
        modules (stage 0), blocks ``<blocks>.<i>`` (global index), head modules (last stage)."""
        lay, out = self.module.layout(), {}
        for s in self.module.stages:
            names = list(lay.embedding) if s == 0 else []
            names += [f"{lay.blocks}.{i}" for i in self.module.layer_ranges[s]]
            if s == self.module.last_stage:
                names += list(lay.head)
            out[s] = names
        return out

    def _actions(self, m: int) -> list:
        """This rank's action list for a flush of ``m`` micro-batches (cached)."""
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.pp, m, self.kind, self.v)[self.rank]
        return self._schedules[m]

    # ---- training ----------------------------------------------------------------------------
    def parameters(self) -> list:
        """The optimizer's parameters: this rank's stage parameters, or ZeRO-1's fp32 master shards."""
        if self.zero is not None:
            return self.zero.parameters()
        return unique_params(self.module)

    def no_sync(self):
        return self.inner.no_sync()

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        if self.ddp is not None and self.experts is not None:
            self.experts.zero_grads()

    def flush_size(self, M: int) -> int:
        """Micro-batches per pipeline flush for ``M`` micro-batches per step: parallel.microbatches,
        or M when that is 0. Raises ValueError if it does not divide M."""
        m = self.microbatches or M
        if M % m:
            raise ValueError(f"this rank has {M} micro-batches per step, not divisible by "
                             f"parallel.microbatches = {m}; choose a divisor of {M} (or 0 = all)")
        return m

    def forward_backward(self, micro_batches, n_global: int, dtype: str, device: torch.device) -> torch.Tensor:
        """Pipelined forward/backward over this rank's micro-batches ``[(x, y), ...]`` (each (b, T)
        int64, the same on every pp rank of a dp coordinate) in M/m flushes; each micro-batch's
        token-CE sum is divided by ``n_global``. Returns this rank's loss sum (float64 scalar, CPU;
        zero except on the last stage). Raises ValueError if M % m != 0 (m =
        parallel.microbatches or M) or the schedule rejects m (interleaved: m % pp != 0)."""
        M = len(micro_batches)
        m = self.flush_size(M)
        total = torch.zeros((), dtype=torch.float64)
        ex = self.executor
        ex.reset_timing()
        n_flush = M // m
        if self.zero is not None:
            self.zero.begin_step()
        if self.stage_sync is not None:  # FSDP2 averages over dp: the loss is pre-scaled
            self.stage_sync.begin_step()
            n_global = n_global / self.stage_sync.loss_scale
        try:
            self._flushes(micro_batches, m, n_flush, n_global, dtype, device, total)
        finally:
            if self.zero is not None:
                self.zero.end_step()
        if self.stage_sync is not None:
            self.stage_sync.end_step()
        wall = ex.busy_s + ex.idle_s
        per_stage = {}  # kind -> {model stage: mean seconds per micro-batch}
        for (kind, chunk), sec in ex.compute_s.items():
            per_stage.setdefault(kind, {})[self.module.stages[chunk]] = sec / ex.compute_n[(kind, chunk)]
        q = ex.p2p
        self._timing = {"busy_s": ex.busy_s, "idle_s": ex.idle_s,
                        "bubble_fraction": ex.idle_s / wall if wall > 0 else 0.0,
                        "post_s": q.post_s, "post_cpu_s": q.post_cpu_s, "recv_wait_s": q.recv_wait_s, "send_wait_s": q.send_wait_s,
                        "other_s": ex.other_s, "walk_start_s": ex.walk_start_s, "walk_end_s": ex.walk_end_s,
                        "p2p_events": list(q.events),
                        "stage_compute_s": per_stage, "schedule": (self.pp, m if self.kind != "naive" else 1,
                                                                   self.kind, self.v)}
        return total

    def _flushes(self, micro_batches, m, n_flush, n_global, dtype, device, total) -> None:
        """The M/m pipeline flushes of one step; adds each micro-batch's loss sum into ``total``."""
        ex = self.executor
        for f in range(n_flush):
            mbs = [(x.to(device), y.to(device)) for x, y in micro_batches[f * m:(f + 1) * m]]
            if self.kind == "naive":
                mbs = [(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs]))]
            sums = []

            def on_output(mb, logits):
                loss = self.loss_sum(logits, mbs[mb][1])
                sums.append(loss.detach())
                return loss / n_global

            final, k = f == n_flush - 1, len(mbs)
            # sync only in the final flush, on each chunk's last backward; if this rank holds the
            # first and the last stage (pp == 1, interleaved) the tied weight's last gradient comes
            # from chunk 0, so the last chunk's final backward must not mark it ready.
            late = self.first and self.last and self.v > 1

            def b_context(mb, chunk):
                if self.zero is not None:  # ZeRO-2/3: reduce-scatter what this backward produced
                    return self._after_backward(mb, chunk)
                if self.stage_sync is not None:  # torch DDP / FSDP2: each chunk its own unit
                    return self.stage_sync.backward_context(chunk, final and mb == k - 1)
                sync = final and mb == k - 1 and not (late and chunk == self.v - 1)
                return contextlib.nullcontext() if sync else self.inner.no_sync()

            w_context = (self._zero3_weight_pass if self.zero is not None and self.zero.stage == 3
                         else self.fsdp2.weight_context if self.fsdp2 is not None else None)
            ex.run(self._actions(k), [x for x, _ in mbs], on_output,
                   lambda: autocast_ctx(dtype, device), b_context, w_context, self.documents)
            for s in sums:
                total += s.double().cpu()

    @contextlib.contextmanager
    def _after_backward(self, mb, chunk):
        yield
        self.zero.after_backward(self._chunk_units[chunk])

    @contextlib.contextmanager
    def _zero3_weight_pass(self, mb, chunk):
        """ZeRO-3 around a W (split backward): the chunk's blocks gathered, then reduce-scatter and free."""
        self.zero.gather_blocks(self._chunk_units[chunk])
        yield
        self.zero.after_backward(self._chunk_units[chunk])

    def last_step_timing(self) -> dict:
        """This rank's pipeline timing of the last ``forward_backward``: ``busy_s`` (compute),
        ``idle_s`` (posting and waiting p2p runs, i.e. bubble + transfer), ``bubble_fraction`` =
        idle / (busy + idle); idle split into ``post_s`` (posting p2p ops; ``post_cpu_s`` of it
        on this thread's CPU, the rest descheduled), ``recv_wait_s`` (waiting
        for receives) and ``send_wait_s`` (waiting for sends at the end of each walk); ``other_s``:
        the walks' remaining wall time (executor bookkeeping, outside busy and idle);
        ``walk_start_s``/``walk_end_s``: ``time.perf_counter()`` at the first walk's start and the
        last one's end (comparable between ranks of one host: start skew); ``p2p_events``: per
        message timestamps (``pipeline.p2p``; :func:`zerotron.parallel.pipeline.accounting.
        recv_wait_split` splits receive waits into dependency and transfer); ``stage_compute_s`` =
        ``{kind: {model stage: mean seconds of one action}}`` for kind "F", "B" of this rank's
        stages (what :func:`zerotron.parallel.pipeline.accounting.predicted_bubble` simulates);
        ``schedule`` = (pp, micro-batches per flush, kind, v). Compare with
        ``simulation.bubble_theory``. Seconds throughout."""
        return dict(self._timing)

    def finish_grads(self) -> None:
        """Wait for the dp gradient reduction, then sum the tied embedding/head gradients between
        the first and last pipeline rank (pp > 1), so both copies get the same update. ZeRO: the
        driver's ``finish_grads`` (stage 1's reduce-scatters, HSDP's replica all-reduce, the tied and
        sequence-parallel sums of the shards in ``parallel.reduce_dtype``)."""
        if self.zero is not None:
            self.zero.finish_grads()
            return
        (self.ddp or self.stage_sync).finish_grads()  # waits for every reduction before the buffers are touched
        if self.experts is not None:  # expert shards: summed over the dp ranks holding the same experts
            self.experts.reduce_grads()
        self._sync_sp_replicated()
        if self.tied_group is not None and self.tied.requires_grad:  # FSDP2: both copies sharded alike over dp
            # (a frozen tied pair, LoRA's base, has no gradient: nothing to sum)
            g = self.tied.grad
            comm.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.tied_group, tag="pp_tied")

    def _sync_sp_replicated(self) -> None:
        """Sequence parallel (DDP path): LayerNorm/bias/wpe gradients saw one sequence shard: sum
        over tp. Must run on memory no collective is writing (after ``ddp.finish_grads`` waited)."""
        if self.module.sequence_parallel:
            sync_replicated_grads(self.module)

    def _norm_params(self) -> list:
        """This rank's parameters for the global norm, the tied copy of the last stage left out
        when the first stage (on another rank) counts it."""
        return [q for q in unique_params(self.module)
                if q.grad is not None and not (q is self.tied and self.last and not self.first)]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient L2 norm: sqrt of the sum of squares over the whole model (tied weight
        counted once); tensor parallel: squares of tp-sharded gradients all-reduced over tp,
        tp-replicated ones (equal on every tp rank) counted once; then all-reduced over pp.
        Identical on every rank. Clips in place (torch's formula, coef = max_norm / (norm + 1e-6)
        capped at 1) when ``max_norm > 0``, the tied copy included. Returns the norm before
        clipping. ZeRO: computed from the dp shards of the flat gradients (each element counted
        once, squares all-reduced over dp as well). One rule for every strategy:
        :func:`zerotron.parallel.grad_norm.clip_grad_norm`."""
        if self.zero is not None:  # the plain runner's rule over the shards, summed over pp too
            return self.zero.clip_grad_norm(max_norm, outer=[self.pp_group])
        counted = self._norm_params()
        extra = [q.grad for q in unique_params(self.module) if q.grad is not None and q is self.tied
                 and all(q is not c for c in counted)]
        shard = getattr(self.stage_sync, "shard_group", None)  # FSDP2: the dp shards are disjoint
        ex = self.experts.ids if self.experts is not None else frozenset()
        parts = [([q.grad for q in counted if is_tp_sharded(q) and id(q) not in ex], [shard, self.tp_group]),
                 ([q.grad for q in counted if not is_tp_sharded(q) and id(q) not in ex], [shard])]
        if ex:  # expert shards: disjoint over ep (tp-replicated)
            parts.append(([q.grad for q in counted if id(q) in ex], [self.experts.ep_group]))
        return clip_grad_norm(parts, max_norm, outer=[self.pp_group], also_clip=extra)

    def build_optimizer(self, tcfg, mask: dict):
        """AdamW over this rank's parameters; ``mask`` (decay by ``id(param)``) may come from the
        dense model or from ``self.module``; the tied copy is never decayed (an embedding)."""
        if self.zero is not None:  # decay flags were fixed per flat buffer at construction
            return self.zero.build_optimizer(tcfg)
        mask = dict(mask)
        if self.tied is not None:
            mask[id(self.tied)] = False
        return build_optimizer(self.parameters(), mask, tcfg)

    def optimizer_step(self, optimizer) -> None:
        if self.zero is not None:  # AdamW on the shards (per parameter where partly used), all-gather
            return self.zero.optimizer_step(optimizer)
        optimizer.step()

    def offload_timing(self) -> dict:
        """The ZeRO driver's host-copy and disk I/O seconds (``ZeroSync.offload_timing``); ``{}``
        without ZeRO offload."""
        return self.zero.offload_timing() if self.zero is not None else {}

    def model_state_bytes(self, optimizer) -> dict:
        """Bytes this rank holds (see ``Strategy.model_state_bytes``; ZeRO: the driver's count of its
        flat buffers, as the plain runner's)."""
        if self.zero is not None:
            return self.zero.model_state_bytes(optimizer)
        return super().model_state_bytes(optimizer)

    # ---- checkpoints and full parameters ---------------------------------------------------------
    def _forward_only(self, x: torch.Tensor, on_output, dtype: str, device: torch.device) -> None:
        acts = forward_only_actions(self.placement, self.rank)
        self.executor.reset_timing()  # the last step's timing is already in _timing; bound the event list
        with self.zero.full_params(blocks=False) if self.zero is not None else contextlib.nullcontext():
            self.executor.run(acts, [x], on_output, lambda: autocast_ctx(dtype, device), documents=self.documents)
        if self.fsdp2 is not None:  # a gradient-free forward leaves units unsharded (zero_stage 2)
            self.fsdp2.reshard()

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor, dtype: str, device: torch.device):
        """Forward-only pipeline of one batch x, y (b, T): ``(loss_sum, valid_count)`` float64 CPU
        scalars on the last stage, zeros elsewhere (the caller sums over ``loss_groups``)."""
        x, y = x.to(device), y.to(device)
        out = [torch.zeros((), dtype=torch.float64)] * 2

        def on_output(mb, logits):
            out[0] = self.loss_sum(logits, y).double().cpu()
            out[1] = torch.tensor(float((y != IGNORE_INDEX).sum()), dtype=torch.float64)

        self._forward_only(x, on_output, dtype, device)
        return out[0], out[1]


