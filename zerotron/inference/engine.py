"""Batched, KV-cached generation on every layout: :class:`Engine`.

Layouts (the mesh's dims and ``microbatches``):
  * single process, or **tensor parallel** (tp > 1): every tp rank runs the same decoding loop on
    its head shards (the KV cache holds the local heads), the logits are gathered over tp
    (``model.parallel_hooks.generation()``), and identically seeded per-request generators draw the
    same tokens on every tp rank;
  * **data parallel** (dp > 1): request i goes to replica ``i % dp``; each replica decodes its own
    requests (with its own copy of the model and the cache) and the outputs are gathered;
  * **pipeline** (pp > 1, any tp): the layers (and their KV cache) are split over the stages and
    the batch into ``microbatches`` micro-batches in flight (``zerotron.inference.pipelined``);
    ``microbatches=1`` is naive model parallelism (one stage busy at a time).
  * **expert parallel** (``ep`` > 1, mixture-of-experts models, tp = pp = 1): the dp ranks form
    groups of ep consecutive ranks, each holding E/ep experts of every MoE layer
    (``zerotron.parallel.expert.inference``). ``ep_split="replica"``: a group is one replica whose
    ranks decode the same rows (requests go to the dp / ep replicas); ``"tokens"``: every rank is a
    replica with its own rows, and each MoE layer sends its tokens to their experts' owners by
    all-to-all, the group's ranks running their forwards in lockstep.

A request's output depends only on its prompt, :class:`SamplingParams` and seed, never on the
layout, the batch or the micro-batch split (greedy: bitwise in fp64; sampling: up to rounding of
the logits). Every rank must call :meth:`Engine.generate` with the same requests.
"""
from __future__ import annotations

import time

import torch

from zerotron.distributed import comm

from .batch import DecodeBatch, Request
from .forward import RunStats, forward_layers, weight_bytes

__all__ = ["Engine", "RunStats", "forward_layers", "weight_bytes"]


class Engine:
    """Generation for ``model`` (the dense ``CausalLM``, identical on every rank, fully initialised
    and in eval mode) over ``mesh``. tp > 1: the model is made tensor-parallel here; pp > 1: split
    into pipeline stages with ``microbatches`` micro-batches in flight (1 = naive model parallel).
    ``max_batch``: requests decoded together per replica (None: all; on a pipeline this is the
    batch split into micro-batches). ``eos_id``: end token id or a tuple of them (None: only max_tokens stops).
    ``pp_split``: layers per pipeline stage ("" = equal counts; "decode" = balanced for decoding,
    the head counted as V / (12 C) blocks: :func:`zerotron.inference.pipelined.decode_split`; or
    counts such as "3,1"). ``decode``: token ids -> text (the tokenizer's), needed by requests with
    ``stop`` strings; identical on every rank, so every rank stops a row at the same token. Raises
    ValueError for microbatches < 1, max_batch < 1 or a bad split. ``ep``: expert-parallel degree
    (``zerotron.models.layout.ep_inference_refusal`` gives the ValueError's reason). ``replicas`` /
    ``replica``: independent decoding groups (dp / ep, or dp with ``ep_split="tokens"``) and this
    rank's; ``ep_rank``: 0 without ep; ``ep_split``: "replica" or "tokens" (module docstring;
    ``lockstep`` the token split's :class:`~zerotron.parallel.expert.inference.Lockstep`, else None).
    ``compile``: decode steps compiled with static shapes (``zerotron.inference.compiled``: one
    compiled call per token; single process and data parallel only, else ValueError with the
    reason)."""

    def __init__(self, model, mesh, microbatches: int = 1, max_batch: int | None = None,
                 eos_id: int | tuple | None = None, pp_split: str = "", decode=None, ep: int = 1,
                 compile: bool = False, ep_split: str = "replica"):
        if microbatches < 1 or (max_batch is not None and max_batch < 1):
            raise ValueError(f"need microbatches >= 1 and max_batch >= 1, got {microbatches}, {max_batch}")
        self.mesh, self.microbatches, self.max_batch, self.eos_id = mesh, microbatches, max_batch, eos_id
        self.decode = decode
        self.tp, self.pp, self.dp = mesh.size("tp"), mesh.size("pp"), mesh.size("dp")
        self.config = model.config
        self.ep, self.ep_rank, self.ep_split, self.lockstep = ep, 0, ep_split, None
        if ep != 1 or ep_split != "replica":
            from zerotron.models.layout import ep_inference_refusal
            reason = ep_inference_refusal(ep, self.dp * self.tp * self.pp, self.tp, self.pp,
                                          {"n_experts": getattr(self.config, "n_experts", 0)}, ep_name="ep",
                                          split=ep_split)
            if reason:
                raise ValueError(reason)
        if ep != 1:
            from zerotron.parallel.expert.inference import shard_for_inference
            self.ep_rank, self.lockstep = shard_for_inference(model, mesh.group("dp"), ep, ep_split)
        per = 1 if self.lockstep is not None else ep  # ranks decoding the same rows
        self.replicas, self.replica = self.dp // per, mesh.local_rank("dp") // per
        model.eval()
        if self.tp > 1:
            from zerotron.parallel.tensor.transform import apply_tensor_parallel
            model = apply_tensor_parallel(model, mesh.group("tp"))
        self.model, self.pipeline = model, None
        if self.pp > 1:
            from .pipelined import PipelinedDecoder, decode_split
            if pp_split == "decode":
                lay = model.layout()
                pp_split = decode_split(self.config.n_layer, self.pp, lay.width, lay.vocab_size)
            self.pipeline = PipelinedDecoder(model, mesh, pp_split)
        from zerotron.models.deferred import target_device

        self.device = target_device(next(iter(model.parameters())))  # not meta: another stage's, released
        self.stats = RunStats()
        self.compiled = None
        if compile:
            from .compiled import CompiledDecoder, compile_refusal
            reason = compile_refusal(self.tp, self.pp, ep)
            if reason:
                raise ValueError(reason)
            self.compiled = CompiledDecoder(model, self.device)

    @property
    def holder(self) -> torch.nn.Module:
        """The module of this rank's weights (the pipeline stage, or the whole model)."""
        return self.pipeline.stage if self.pipeline is not None else self.model

    def weight_bytes(self) -> int:
        """Weight storage bytes on this rank."""
        return weight_bytes(self.holder)

    @torch.inference_mode()  # no autograd bookkeeping at all: less per-op overhead than no_grad
    def generate(self, requests: list[Request], on_token=None) -> list[list[int]]:
        """New tokens of each request (eos included when it stopped there; with stop strings, up to
        the token that completed one), in input order, on every rank. Collective over the whole
        mesh: every rank passes the same ``requests``. ``on_token(i, token)``: called as request i
        gets each new token, on the ranks that see it then (tp ranks, pipeline stage 0 and the last
        stage; with dp only for the replica's own requests: the others' come with the result).
        Raises ValueError for an empty prompt, invalid sampling parameters or stop strings without
        a ``decode`` function (before any collective)."""
        for r in requests:
            r.params.validate()
            if not r.prompt:
                raise ValueError("every request needs a non-empty prompt")
            if r.params.stop and self.decode is None:
                raise ValueError("requests with stop strings need an Engine built with decode= (the tokenizer)")
        t0, c0 = time.perf_counter(), time.process_time()
        self.stats = stats = RunStats()
        mine = [i for i in range(len(requests)) if i % self.replicas == self.replica]
        out: dict[int, list[int]] = {}
        step = self.max_batch or max(len(mine), 1)
        with self.model.parallel_hooks.generation():
            for lo in range(0, len(mine), step):
                idx = mine[lo:lo + step]
                batch_reqs = [requests[i] for i in idx]
                if self.pipeline is not None:
                    res = self.pipeline.run(batch_reqs, idx, self.microbatches, self.eos_id, stats, t0,
                                            self.decode, on_token)
                else:
                    res = self._run_local(batch_reqs, idx, stats, t0, on_token)
                out.update(zip(idx, res))
            while self.lockstep is not None and self.lockstep.any_active(False):
                self.lockstep.idle_forward()  # a peer still decodes: its all-to-alls need this rank
        if self.dp > 1:
            merged: dict[int, list[int]] = {}
            for part in comm.all_gather_object(out, group=self.mesh.group("dp")):
                merged.update(part)
            out = merged
        stats.wall_s, stats.cpu_s = time.perf_counter() - t0, time.process_time() - c0
        return [out[i] for i in range(len(requests))]

    def _run_local(self, requests, index, stats: RunStats, t0: float, on_token=None) -> list[list[int]]:
        """Single-process / tensor-parallel decoding of one batch."""
        model, cfg = self.model, self.config
        batch = DecodeBatch(requests, index, cfg.n_layer, cfg.block_size, self.eos_id, self.device,
                            self.decode, on_token)
        blocks, layers = model.blocks(), list(range(cfg.n_layer))
        last_t = None
        while not batch.finished:
            if self.lockstep is not None:  # token-split ep: each step's forward paired with the peers'
                self.lockstep.any_active(True)
            tb = time.perf_counter()
            idx, pad = batch.next_input()
            if pad is None and self.compiled is not None:  # a decode step: one compiled call
                logits = self.compiled.step(batch, idx)
            else:
                cache = batch.start(pad, idx.size(1))
                logits = forward_layers(model, blocks, layers, idx, cache, True, True)
            batch.advance(batch.sample(logits))
            stats.kv_cache_bytes = max(stats.kv_cache_bytes, batch.kv_bytes())
            batch.compact()  # finished rows leave the batch and the cache
            now = time.perf_counter()
            stats.busy_s += now - tb
            if stats.first_token_s is None:
                stats.first_token_s = now - t0
            elif last_t is not None:
                stats.step_s.append(now - last_t)
            last_t = now
        stats.new_tokens += sum(len(n) for n in batch.new)
        return batch.new
