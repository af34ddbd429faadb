"""The named layouts of the parity matrix: the :data:`MUST` witnesses every covering array holds
(and the model families each trains in), and the layouts that run once more with a feature that is
not a factor -- document masking (with its corpus), LoRA, optimizer and parameter offload."""
from __future__ import annotations

import dataclasses

from .layout import Layout

# always in the covering set: pp x dp x tp + SP with native DDP (witness of a fixed defect: the
# tp-replicated gradient sum once ran on bucket memory an all-reduce was still writing),
# pipeline x ZeRO-3 with interleaving (per-action reduce-scatter, blocks gathered per chunk),
# the split backward of zb-h1 under ZeRO-2/3 over a real dp group (reduce-scatter after each W,
# ZeRO-3 blocks gathered for W) and under DDP buckets with tensor parallelism (buckets fire in W),
# zb-v's V placement (first and last stage on rank 0, the tied weight local) under ZeRO-3 and
# under DDP with tensor parallelism, and HSDP (dp 4 = 2 replicas x 2 shards) for ZeRO-2, ZeRO-3 and hierarchical DDP, with accumulation
# (shard gradients summed locally, one all-reduce across replicas per step), with tp 2 and (DDP) under a 1F1B pipeline;
# pipeline x native HSDP ZeRO (the plain runner's driver per pipeline rank: shard-group reductions
# per backward action, replica all-reduce in finish_grads): ZeRO-3 over dp 4 = 2 x 2 under 1F1B,
# ZeRO-1 over dp 2 = 2 replicas x 1 under ZB-H1's split backward
MUST = ("ddp-dp2-tp2sp-pp2-1f1b-acc4", "zero3-dp2-pp2-interleaved-acc4", "zero2-dp2-pp2-zb-h1-acc4",
        "zero3-dp2-pp2-zb-h1-acc4", "ddp-dp2-tp2-pp2-zb-h1-acc4", "zero3-dp2-pp2-zb-v-acc4", "ddp-dp2-tp2sp-pp2-zb-v-acc4", "zero2-dp4r2-acc4", "zero3-dp4r2-acc1",
        "ddp-dp4r2-acc4", "zero3-dp4r2-tp2-acc4", "fsdp2_3-dp4r2-acc1", "ddp-dp4r2-pp2-1f1b-acc4",
        "zero3-dp4r2-pp2-1f1b-acc4", "zero1-dp2r2-pp2-zb-h1-acc4",
        # pipeline ZeRO x tp without SP (the norm sums the tp-sharded shards over tp; only SP sums replicated ones)
        "zero2-dp1-tp2-pp2-1f1b-acc4",
        # one per torch.distributed.pipelining schedule, over a real dp group where it fits in 4 ranks
        "ddp-dp2-pp2-torch-gpipe-acc4", "ddp-dp2-pp2-torch-1f1b-acc4", "ddp-dp2-pp2-torch-interleaved-acc4",
        "ddp-dp2-pp2-torch-zb-acc4",
        # FSDP2 over dp x native tensor parallelism (torchtitan's 2-D layout), stages 2 and 3, +- SP
        "fsdp2_2-dp2-tp2-acc4", "fsdp2_2-dp2-tp2sp-acc1-acfull", "fsdp2_3-dp2-tp2-acc1", "fsdp2_3-dp2-tp2sp-acc4",
        # full recomputation under parameter sharding: native ZeRO-3 (the recompute runs between the
        # block's backward gather and its free), in a pipeline (the same driver per rank), and FSDP2 stage 3
        "zero3-dp2-acc4-acfull", "zero3-dp2-pp2-1f1b-acc4-acfull", "fsdp2_3-dp2-acc4-acfull",
        # torch DDP per pipeline chunk (parallel.pipeline.stage_sync): 1F1B, and zb-v (split backward,
        # the tied pair on one rank reduced by the first stage's DDP, ignored by the last one's)
        "torch_ddp-dp2-pp2-1f1b-acc4", "torch_ddp-dp2-pp2-zb-v-acc4",
        # FSDP2 per pipeline rank (parallel.pipeline.stage_sync.StageFSDP2): ZeRO-3 under 1F1B, ZB-H1's
        # split backward and ZB-V's V (first and last stage on one rank), interleaved ZeRO-2, ZeRO-2 x tp
        "fsdp2_3-dp2-pp2-1f1b-acc4", "fsdp2_3-dp2-pp2-zb-h1-acc4", "fsdp2_3-dp2-pp2-zb-v-acc4",
        "fsdp2_2-dp2-pp2-interleaved-acc4", "fsdp2_2-dp2-pp2-gpipe-acc1", "fsdp2_2-dp1-tp2sp-pp2-1f1b-acc4",
        # context parallelism (all-gather attention): alone (cp 2, cp 4), over native DDP, torch DDP, ZeRO-1,
        # ZeRO-3 and FSDP2 (batch group dp x cp, shards over dp_shard x cp), HSDP ZeRO-3, tp 2 without and with SP,
        # and full recomputation (the all-gather rerun in backward)
        "ddp-dp1-cp2-allgather-acc4", "ddp-dp1-cp4-allgather-acc1", "ddp-dp2-cp2-allgather-acc4",
        "torch_ddp-dp2-cp2-allgather-acc1", "zero1-dp2-cp2-allgather-acc4", "zero3-dp2-cp2-allgather-acc1",
        "fsdp2_3-dp2-cp2-allgather-acc4", "fsdp2_2-dp2r2-cp2-allgather-acc1", "zero3-dp2r2-cp2-allgather-acc4",
        "ddp-dp1-cp2-allgather-tp2-acc4", "zero3-dp1-cp2-allgather-tp2sp-acc1", "fsdp2_3-dp2-cp2-allgather-tp2sp-acc1",
        "zero2-dp1-cp2-allgather-acc4-acfull",
        # ring attention (p2p K/V rotation, zigzag chunks) and all-to-all (Ulysses heads <-> sequence)
        # under the same syncs: alone at cp 2 and 4, over DDP, ZeRO-3, FSDP2 and tp 2 + SP, with recomputation
        "ddp-dp1-cp2-ring-acc4", "ddp-dp1-cp4-ring-acc1", "zero3-dp2-cp2-ring-acc4", "fsdp2_3-dp2-cp2-ring-tp2sp-acc1",
        "zero2-dp1-cp2-ring-acc4-acfull", "ddp-dp1-cp2-a2a-acc4", "zero1-dp2-cp2-a2a-acc1", "torch_ddp-dp2-cp2-a2a-acc4",
        # context parallelism under the native pipeline (each stage's attention over the cp group, p2p activations
        # (b, T/cp, C) between the same cp coordinates, gradients over dp x cp per stage): ring under 1F1B and
        # all-to-all under ZB-H1's split backward, both with full recomputation (the attention's traffic rerun in B
        # and W), and tp 2 + SP under 1F1B (8 ranks; the covering array adds dp 2 x cp 2 x pp 2 and the other schedules)
        "ddp-dp1-cp2-ring-pp2-1f1b-acc4-acfull", "ddp-dp1-cp2-a2a-pp2-zb-h1-acc4-acfull",
        "ddp-dp1-cp2-ring-tp2sp-pp2-1f1b-acc4-acfull")


def witness_families(layout: Layout) -> tuple[str, ...]:
    """The model families a :data:`MUST` witness trains in, in the joint covering array
    (:func:`joint_covering`): both where the families differ in what the witness exercises -- a
    pipeline with tp or cp (GPT-2's tied embedding spans the first and last stage, while Llama's
    kv heads are split over tp and its RoPE positions over cp) -- else the family whose structure
    the witness strains more: GPT-2 for pipelines (the tied pair) and for layouts without tp or cp
    (the tied parameter shared by two modules under every gradient sync), Llama for tp or cp
    without a pipeline (grouped-query kv heads over tp, all-to-all over kv heads, RoPE)."""
    if layout.pp > 1 and (layout.tp > 1 or layout.cp > 1):
        return ("gpt2", "llama")
    if layout.pp == 1 and (layout.tp > 1 or layout.cp > 1):
        return ("llama",)
    return ("gpt2",)


# document masking (data.doc_mask), trained with the masks on a corpus of short documents
# (:func:`doc_corpus`) against one process with the masks: these layouts run once more with
# doc_mask = true -- dp 2, tp 2 + SP, a 1F1B pipeline with full recomputation (the recompute in
# a B action re-reads its micro-batch's documents), cp 2 ring with recomputation, cp 2 all-to-all,
# cp 2 all-gather over dp 2 (ZeRO-1 over the batch group dp x cp), cp 2 ring under a 1F1B pipeline
# (each stage's attention gathers the micro-batch's documents over cp)
DOC_MASK = ("ddp-dp2-acc4", "ddp-dp1-tp2sp-acc1", "ddp-dp1-pp2-1f1b-acc4-acfull", "zero2-dp1-cp2-ring-acc4-acfull",
            "ddp-dp1-cp2-a2a-acc4", "zero1-dp2-cp2-allgather-acc4", "ddp-dp1-cp2-ring-pp2-1f1b-acc4-acfull")


# LoRA (train.lora_rank; the default targets, attention projections: a column-parallel [q|k|v] or q, k, v
# and a row-parallel output projection), trained against one process with the same adapters: frozen
# base weights in their own ZeRO flat buffers (ZeRO-1, ZeRO-3, with recomputation, under a pipeline),
# FSDP2 units mixing frozen and trainable parameters, adapters split over tp with and without SP
# (alone, under ZeRO-3 and FSDP2), dp 2 and a 1F1B pipeline over native DDP
LORA = ("ddp-dp2-acc4", "zero1-dp2-acc4", "zero3-dp2-acc4-acfull", "zero3-dp2-acc1", "fsdp2_3-dp2-acc4",
        "fsdp2_2-dp2-acc1", "ddp-dp1-tp2-acc4", "ddp-dp1-tp2sp-acc1", "zero3-dp1-tp2sp-acc4",
        "fsdp2_3-dp2-tp2sp-acc1", "ddp-dp2-pp2-1f1b-acc4", "zero3-dp2-pp2-1f1b-acc4")
# the LoRA witnesses of the default suite (the rest under ZEROTRON_SFT_FULL=1): ZeRO-3 over dp 2 with
# recomputation, tp 2 + SP, FSDP2 x tp 2 + SP, and a 1F1B pipeline over ZeRO-3 dp 2
LORA_CI = ("zero3-dp2-acc4-acfull", "ddp-dp1-tp2sp-acc1", "fsdp2_3-dp2-tp2sp-acc1", "zero3-dp2-pp2-1f1b-acc4")


def lora_layouts(layouts: list[Layout], names=LORA) -> list[Layout]:
    """The LoRA witnesses ``names`` (default :data:`LORA`; :data:`LORA_CI`) among ``layouts``, with
    ``lora`` on."""
    return [dataclasses.replace(l, lora=True) for l in layouts if l.name in names]


# optimizer offload (train.offload), not a factor: the master shards and Adam state in host buffers
# (optimizer) or in memory-mapped files stepped chunk by chunk (optimizer-disk) -- HSDP ZeRO-2 in
# host memory, pipeline ZeRO-1 (1F1B) and ZeRO-3 x tp 2 on disk; parameter offload (params: the stage-3
# shards at rest on the host) under a 1F1B pipeline of native ZeRO-3 and with FSDP2's CPUOffloadPolicy
OFFLOAD = (("zero2-dp4r2-acc4", "optimizer"), ("zero1-dp2-pp2-1f1b-acc4", "optimizer-disk"),
           ("zero3-dp2-tp2-acc1", "optimizer-disk"), ("zero3-dp2-pp2-1f1b-acc4", "params"),
           ("fsdp2_3-dp2-acc4", "params"))


def offload_layouts(layouts: list[Layout]) -> list[Layout]:
    """The :data:`OFFLOAD` witnesses among ``layouts``, with their ``offload`` mode."""
    modes = dict(OFFLOAD)
    return [dataclasses.replace(l, offload=modes[l.name]) for l in layouts if l.name in modes]


def doc_mask_layouts(layouts: list[Layout]) -> list[Layout]:
    """The :data:`DOC_MASK` witnesses among ``layouts``, with ``doc_mask`` on."""
    return [dataclasses.replace(l, doc_mask=True) for l in layouts if l.name in DOC_MASK]


def doc_corpus(path: str, lines: int = 4000) -> str:
    """Write the document-masking corpus to ``path`` (a .jsonl, one document per line): the first
    ``lines`` non-empty lines of the first Shakespeare play, each a document of a few tokens, so
    most 16-token windows of the matrix hold several documents. Returns ``path``."""
    import json

    from zerotron.data.corpus import load_corpus

    text = load_corpus("shakespeare", None, "text")[0]
    docs = [ln.strip() for ln in text.splitlines() if ln.strip()][:lines]
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return path
