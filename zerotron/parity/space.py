"""The layout space of the parity matrix: the factors, every layout of their product, the plan's
verdict on each and the documented reasons for the refused ones, and the pairwise covering array
(see the package docstring, ``zerotron.parity``)."""
from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
from dataclasses import dataclass

from zerotron.config import ConfigError
from zerotron.models.layout import a2a_refusal
from zerotron.plan import CHUNKED_SCHEDULES, build_plan

FACTORS = {
    "sync": ("ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp2_2", "fsdp2_3"),
    "dp": (1, 2, 4),
    "tp": (1, 2),
    "sp": (False, True),
    "pp": (1, 2, 4),
    "schedule": ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "threads",
                 "torch-gpipe", "torch-1f1b", "torch-interleaved", "torch-zb"),
    "acc": (1, 4),
    "split": ("auto", "even"),
    "rep": (1, 2),  # parallel.dp_replicate (HSDP: dp = rep replicas x dp/rep shards)
    "ac": ("none", "full"),  # train.activation_checkpointing (full: every block recomputed in backward)
    "cp": (1, 2, 4),  # parallel.cp (context parallel: each sequence split over cp ranks, outside tp)
    "cp_impl": ("ring", "a2a", "allgather"),  # parallel.cp_impl (parallel.context: ring, Ulysses all-to-all, Llama 3 all-gather)
}
# the torch.distributed.pipelining backend (parallel.pp_impl = torch): matrix schedule -> pp_schedule
TORCH_KINDS = {"torch-gpipe": "gpipe", "torch-1f1b": "1f1b", "torch-interleaved": "interleaved", "torch-zb": "zb-h1"}
MAX_WORLD = 8
STEPS = 2
GLOBAL_BATCH = 16
FP64_RTOL = 1e-10
# the matrix model: 8 layers (pp 4 x 2 virtual stages), 4 heads (tp 2), 16 positions (SP over tp 2)
MODEL = {"model.n_layer": 8, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 16,
         "model.dropout": 0.0}
# model families of the matrix (overrides on top of MODEL): GPT-2, and Llama with grouped-query
# attention (4 query heads on 2 kv heads, so tp 2 splits both), SwiGLU, RoPE, untied head
MODELS = {"gpt2": {},
          "llama": {"model.arch": "llama", "model.n_kv_head": 2, "model.intermediate_size": 64,
                    "model.rope_theta": 10000.0}}
TRAIN = {"train.dtype": "fp64", "train.steps": STEPS, "train.global_batch": GLOBAL_BATCH, "train.grad_clip": 0.5,
         "train.warmup_steps": 1, "train.eval_every": STEPS, "train.eval_batches": 1,
         "checkpoint.save_final": "false", "parallel.timeout_s": 120,
         "log.tensorboard": "false"}


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the matrix. ``schedule`` and ``split`` are None when pp == 1; ``sp`` is False
    when tp == 1; ``cp_impl`` is None when cp == 1."""

    sync: str
    dp: int
    tp: int
    sp: bool
    pp: int
    schedule: str | None
    acc: int
    split: str | None = None
    rep: int = 1
    ac: str = "none"
    cp: int = 1
    cp_impl: str | None = None
    doc_mask: bool = False  # data.doc_mask (not a factor: the DOC_MASK witnesses, on a corpus of short documents)
    ep: int = 1  # parallel.ep (the MoE family's factor, :func:`moe_layouts`; carved out of dp x cp: no extra ranks)
    lora: bool = False  # LoRA adapters (not a factor: the LORA witnesses, against a LoRA reference, :data:`LORA_TRAIN`)
    offload: str = "none"  # train.offload (not a factor: the OFFLOAD witnesses)

    @property
    def world(self) -> int:
        """Processes: dp x cp x tp x pp, except for "threads" (the pp stages are threads of one process)."""
        return self.dp * self.cp * self.tp * (1 if self.schedule == "threads" else self.pp)

    @property
    def name(self) -> str:
        parts = [self.sync, f"dp{self.dp}" + (f"r{self.rep}" if self.rep > 1 else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_impl}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("sp" if self.sp else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}-{self.schedule}" + ("-even" if self.split == "even" else ""))
        parts.append(f"acc{self.acc}")
        if self.ac != "none":
            parts.append(f"ac{self.ac}")
        if self.doc_mask:
            parts.append("docmask")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.lora:
            parts.append("lora")
        if self.offload != "none":
            parts.append({"optimizer": "offopt", "optimizer-disk": "offdisk", "params": "offparam"}[self.offload])
        return "-".join(parts)

    def overrides(self) -> dict:
        """``{"section.field": value}`` config overrides of this layout (on top of MODEL/TRAIN)."""
        o = {"parallel.dp": self.dp, "parallel.tp": self.tp, "parallel.pp": self.pp,
             "parallel.sequence_parallel": str(self.sp).lower(), "parallel.dp_replicate": self.rep,
             "train.micro_batch": max(GLOBAL_BATCH // (self.dp * self.acc), 1),
             "train.activation_checkpointing": self.ac, "parallel.cp": self.cp}
        if self.cp > 1:
            o["parallel.cp_impl"] = self.cp_impl
        if self.doc_mask:
            o["data.doc_mask"] = "true"
        if self.ep > 1:
            o["parallel.ep"] = self.ep
        if self.lora:
            o.update(LORA_TRAIN)
        if self.offload != "none":
            o["train.offload"] = self.offload
        if self.offload == "optimizer-disk":  # the state files are unlinked once mapped: one shared folder
            o["train.offload_dir"] = os.path.join(tempfile.gettempdir(), "zerotron-parity-offload")
        if self.sync == "torch_ddp":
            o["parallel.dp_impl"] = "torch"
        elif self.sync.startswith("zero"):
            o["parallel.zero_stage"] = int(self.sync[-1])
        elif self.sync.startswith("fsdp2"):
            o.update({"parallel.zero_stage": int(self.sync[-1]), "parallel.zero_impl": "fsdp2"})
        if self.schedule == "threads":  # GPipe over pp worker threads of each process
            o.update({"parallel.pp": 1, "parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe",
                      "parallel.virtual_stages": self.pp, "parallel.pp_split": self.split or "auto"})
        elif self.schedule in TORCH_KINDS:  # torch.distributed.pipelining on the same split
            o.update({"parallel.pp_impl": "torch", "parallel.pp_schedule": TORCH_KINDS[self.schedule],
                      "parallel.pp_split": self.split or "auto"})
            if self.schedule == "torch-interleaved":
                o["parallel.virtual_stages"] = 2
        elif self.pp > 1:
            o["parallel.pp_schedule"] = self.schedule
            o["parallel.pp_split"] = self.split or "auto"
            if self.schedule in CHUNKED_SCHEDULES:  # interleaved loop, zb-v's V: two stages per rank
                o["parallel.virtual_stages"] = 2
        return o

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "name": self.name, "world": self.world}


def all_layouts(max_world: int = MAX_WORLD) -> list[Layout]:
    """Every canonical layout of the FACTORS product on at most ``max_world`` processes, sorted."""
    out = set()
    f = FACTORS
    for sync, dp, tp, sp, pp, sched, acc, split, rep, ac, cp, cp_impl in itertools.product(*f.values()):
        lay = Layout(sync, dp, tp, sp and tp > 1, pp, sched if pp > 1 else None, acc, split if pp > 1 else None, rep,
                     ac, cp, cp_impl if cp > 1 else None)
        if lay.world <= max_world:
            out.add(lay)
    return sorted(out, key=lambda l: (l.world, l.name))


def config_for(layout: Layout, extra: dict | None = None):
    """The full Config of ``layout`` (tiny.toml + MODEL + TRAIN + the layout's overrides + extra)."""
    from zerotron.testing import tiny_config

    return tiny_config({**MODEL, **TRAIN, **layout.overrides(), **(extra or {})})


def refusal(layout: Layout) -> str | None:
    """The plan's verdict (``plan.build_plan``) for every model family of :data:`MODELS` (a layout
    runs when each family's does; e.g. all-to-all cp depends on the kv heads): None if it runs,
    else the first family's one-line message."""
    for extra in MODELS.values():
        try:
            build_plan(config_for(layout, extra), layout.world)
        except ConfigError as e:
            return str(e)
    return None


def _shape(extra: dict) -> dict:
    """The head counts of one matrix model family (MODEL + its overrides) as the plan sees them."""
    m = {**MODEL, **extra}
    return {"n_head": m["model.n_head"], "n_kv_head": m.get("model.n_kv_head")}


def expected_refusal(layout: Layout) -> str | None:
    """The documented reason a layout cannot run (None: it must run). Config validation must agree
    (tests assert both directions), so an accidental refusal or a silently accepted unsupported
    combination fails the matrix."""
    if layout.rep > 1 and layout.dp % layout.rep:
        return "HSDP: parallel.dp_replicate must divide dp"
    if layout.rep > 1 and layout.sync == "torch_ddp":
        return "HSDP: torch DDP reduces over one flat group"
    if layout.rep > 1 and layout.pp > 1 and (layout.sync not in ("ddp", "zero1", "zero2", "zero3")
                                             or layout.schedule == "threads" or layout.schedule in TORCH_KINDS):
        return "HSDP under a pipeline runs with native DDP or native ZeRO on the native executor only"
    if layout.schedule in TORCH_KINDS and (layout.sync != "ddp" or layout.tp > 1):
        return "the torch.distributed.pipelining backend combines only with native DDP, tp = 1"
    if layout.schedule == "torch-1f1b" and layout.acc < layout.pp:
        return "torch's Schedule1F1B needs micro-batches per flush >= pp"
    if layout.schedule in ("interleaved", "torch-interleaved") and layout.acc % layout.pp:
        return "interleaved needs micro-batches per flush divisible by pp"
    if layout.schedule == "threads" and (layout.sync != "ddp" or layout.tp > 1):
        return "the threaded executor (pp stages as threads of one process) combines only with native DDP, tp = 1"
    if layout.cp > 1 and (layout.schedule == "threads" or layout.schedule in TORCH_KINDS):
        return "context parallelism under a pipeline runs on the native executor only"
    if layout.lora and (layout.cp > 1 or layout.schedule == "threads" or layout.schedule in TORCH_KINDS):
        return "LoRA runs without context parallelism, on the plain runner and the native pipeline executor"
    if layout.doc_mask and (layout.schedule == "threads" or layout.schedule in TORCH_KINDS):
        return "document masking runs on the plain runner and the native pipeline executor only"
    if layout.cp_impl == "a2a" and any(a2a_refusal(layout.cp, layout.tp, _shape(e)) for e in MODELS.values()):
        return "all-to-all context parallelism needs cp to divide the kv heads per tp rank (of every family)"
    return None


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
LORA_TRAIN = {"train.lora_rank": 4, "train.lr": 0.05}
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


def _greedy_cover(rows: list[list], costs: list[int], n_fixed: int) -> list[int]:
    """The greedy pairwise covering array over ``rows`` (each a list of (factor, value) assignments,
    in one factor order): the indices of the first ``n_fixed`` rows (the witnesses), then in each
    round the row that covers the most pairs still missing, ties to the lower ``costs`` (processes,
    < 16), then to the lower index, until every pair that occurs in some row occurs in a chosen one.
    Each row's pairs are one row of column ids; its count of missing pairs is kept in one array and
    lowered as pairs get covered (the same choice as recounting every row's pairs each round)."""
    import numpy as np

    ids: dict = {}  # (assignment, assignment) pair -> column
    cols = np.array([[ids.setdefault(p, len(ids)) for p in itertools.combinations(r, 2)] for r in rows],
                    dtype=np.int64).reshape(len(rows), -1)
    todo = np.ones(len(ids), dtype=bool)
    todo[cols[:n_fixed].ravel()] = False  # the pairs the witnesses cover
    # rank of each row: 16 x missing pairs it holds - its cost (costs < 16)
    score = todo[cols].sum(axis=1) * 16 - np.asarray(costs, dtype=np.int64)
    score[:n_fixed] = low = np.iinfo(np.int64).min
    chosen = list(range(n_fixed))
    while todo.any():
        b = int(np.argmax(score))  # the first maximum in row order: the tie rule
        chosen.append(b)
        covered = np.zeros(len(ids), dtype=bool)
        covered[cols[b][todo[cols[b]]]] = True
        todo &= ~covered
        score -= covered[cols].sum(axis=1) * 16
        score[b] = low
    return chosen


def _assignments(lay: Layout, keys: list) -> list:
    return [(k, getattr(lay, k)) for k in keys]


def covering_layouts(layouts: list[Layout], must: tuple = MUST, extra_keys: tuple = ()) -> list[Layout]:
    """A greedy pairwise covering array (:func:`_greedy_cover`): a subset of ``layouts`` in which
    every pair of (factor, value) assignments that occurs in ``layouts`` occurs at least once, plus
    the ``must`` witnesses (:data:`MUST`); ``extra_keys``: Layout fields that count as factors too
    (the MoE family's "ep"). Ties go to fewer processes, then to the name, so the choice is
    deterministic. Returns the layouts sorted by (world, name)."""
    keys = list(FACTORS) + list(extra_keys)
    fixed = [l for l in layouts if l.name in must]
    rest = sorted((l for l in layouts if l.name not in must), key=lambda l: (l.world, l.name))
    cand = fixed + rest
    pick = _greedy_cover([_assignments(l, keys) for l in cand], [l.world for l in cand], len(fixed))
    return sorted((cand[i] for i in pick), key=lambda l: (l.world, l.name))


def joint_covering(layouts: list[Layout], families: tuple = tuple(MODELS), must: tuple = MUST,
                   witness=witness_families) -> list[tuple[str, Layout]]:
    """One pairwise covering array over every model family at once, the family as one more factor:
    ``(family, layout)`` pairs in which every pair of (factor, value) assignments that occurs in
    ``families x layouts`` occurs at least once -- (family, value) pairs included, so each family
    sees every value of every factor -- plus the witnesses ``must`` (:data:`MUST`), each in the
    families ``witness(layout)`` names (:func:`witness_families`). Roughly half the layouts of one
    covering array per family.
    Ties go to fewer processes, then to the name, then to the family order. Returns the pairs sorted
    by (world, name, family)."""
    keys = list(FACTORS)
    order = {f: i for i, f in enumerate(families)}
    fams = {l.name: [f for f in witness(l) if f in order] for l in layouts if l.name in must}
    fixed = [(f, l) for l in layouts for f in fams.get(l.name, ())]
    rest = sorted(((f, l) for l in layouts for f in families if f not in fams.get(l.name, ())),
                  key=lambda x: (x[1].world, x[1].name, order[x[0]]))
    cand = fixed + rest
    pick = _greedy_cover([[("family", f)] + _assignments(l, keys) for f, l in cand], [l.world for _, l in cand],
                         len(fixed))
    return sorted((cand[i] for i in pick), key=lambda x: (x[1].world, x[1].name, order[x[0]]))


# ---- the mixture-of-experts family (issue 29) ------------------------------------------------
# Mixtral-style blocks on the matrix model, 4 of them (half the cost; pp 4 with two stages per rank
# is then refused): 4 experts, top-2, both auxiliary losses on (weights 0.1
# and 0.01; their gradients enter the parameters, so a layout that took them over other tokens,
# weighed them differently or synchronised expert gradients over the wrong group fails). The
# load-balancing loss is per micro-batch, so every MoE layout (and the one-process reference) runs
# at train.micro_batch = MOE_MICRO_BATCH: a layout's ``acc`` is then GLOBAL_BATCH / (dp x 2).
MOE_MICRO_BATCH = 2
MOE_MODEL = {"model.arch": "mixtral", "model.n_layer": 4, "model.n_kv_head": 2, "model.intermediate_size": 24, "model.n_experts": 4,
             "model.experts_top_k": 2, "model.moe_aux_loss_coef": 0.1, "model.moe_z_loss_coef": 0.01,
             "model.rope_theta": 10000.0, "train.micro_batch": MOE_MICRO_BATCH}
EP = (1, 2, 4)  # parallel.ep: experts split over ep ranks carved out of dp x cp (ep must divide dp x cp)
# in the default suite: recomputation under ZeRO-3 (router statistics not counted twice), a 1F1B
# pipeline, FSDP2 stage 3 (its gradient average over dp once missed the auxiliary losses' share),
# expert parallelism under ZeRO-1 at ep = dp = 2, ZeRO-2 at dp 4 = 2 expert replicas x ep 2 (expert
# flat buffers sharded over the replica group), and dp 2 x tp 2 with ep 2 (one ep group per tp
# coordinate, experts tp-replicated) under DDP and ZeRO-3; ep 2 under FSDP2 (experts fully_shard-ed
# over dp/ep: their gradient average is over dp/ep ranks, not dp) and under torch DDP (experts in its
# ignore list)
MOE_MUST = ("zero3-dp2-acc4-acfull", "ddp-dp1-pp2-1f1b-even-acc8", "fsdp2_3-dp2-acc4", "zero1-dp2-acc4-ep2",
            "zero2-dp4-acc2-ep2", "ddp-dp2-tp2-acc4-ep2", "zero3-dp2-tp2-acc4-ep2",
            # expert parallelism under a pipeline (each stage's all-to-all in its F and B; ZB-H1's W of the
            # expert weights local, ZeRO-3 gathering the stage's expert shards for it), and sequence
            # parallelism (router statistics summed over the tp shards of each micro-batch) with ep 2, and
            # context parallelism (the same sums over the cp chunks; ring attention)
            "ddp-dp2-pp2-1f1b-acc4-ep2", "zero3-dp2-pp2-zb-h1-acc4-ep2", "zero1-dp2-tp2sp-acc4-ep2",
            "ddp-dp1-cp2-ring-acc8", "fsdp2_3-dp2-acc4-ep2", "torch_ddp-dp2-acc4-ep2",
            # expert parallelism under context parallelism: the ep group is the cp pair (each chunk's
            # tokens routed to the other rank's experts), ring attention under ZeRO-1, a2a under FSDP2
            "zero1-dp1-cp2-ring-acc8-ep2", "fsdp2_3-dp1-cp2-a2a-acc8-ep2",
            # torch's pipelining: its shape inference (a first forward per stage) must not count in the
            # router statistics (it did: aux_err 0.125 in every torch-pipelining MoE layout)
            "ddp-dp1-pp2-torch-gpipe-acc8")
# witnesses of the full MoE run (``make test-moe``) only, 4 processes each: FSDP2 stage 2 at dp 4 =
# ep 2 x 2 expert replicas (the experts' own reduce-scatter group), native HSDP with ep inside the
# shard group (ZeRO-2 and DDP, dp 4 = 2 replicas x 2 shards), FSDP2 x tp with ep
MOE_MUST_FULL = MOE_MUST + ("fsdp2_2-dp4-acc2-ep2", "zero2-dp4r2-acc2-ep2", "ddp-dp4r2-acc2-ep2",
                            "fsdp2_3-dp2-tp2-acc4-ep2",
                            # ep over dp x cp (4 ranks, one ep group; 2 groups of cp pairs), under a pipeline
                            "ddp-dp2-cp2-ring-acc4-ep4", "zero3-dp2-cp2-a2a-acc4-ep2",
                            "torch_ddp-dp1-cp2-ring-acc8-ep2", "zero1-dp1-cp2-a2a-pp2-1f1b-acc8-ep2")


def moe_layouts(max_world: int = 4) -> list[Layout]:
    """The MoE family's layout space: every layout of :func:`all_layouts` with ``acc`` fixed by
    :data:`MOE_MICRO_BATCH` (duplicates merged) times every ep of :data:`EP` dividing its dp x cp, sorted."""
    # the product without the factors that only matter when another is > 1 (as :func:`all_layouts`
    # canonicalises them), which are expanded where they do: 20x fewer combinations
    inner = {"schedule": "pp", "split": "pp", "cp_impl": "cp", "sp": "tp"}
    outer = [k for k in FACTORS if k not in inner and k != "acc"]
    out = set()
    for values in itertools.product(*(FACTORS[k] for k in outer)):
        base = dict(zip(outer, values))
        if base["dp"] * base["cp"] * base["tp"] > max_world:
            continue
        opts = [[(k, v) for v in (FACTORS[k] if base[on] > 1 else (False if k == "sp" else None,))]
                for k, on in inner.items()]
        for extra in itertools.product(*opts):
            lay = Layout(**base, **dict(extra), acc=max(GLOBAL_BATCH // (base["dp"] * MOE_MICRO_BATCH), 1))
            if lay.world <= max_world:
                out.update(dataclasses.replace(lay, ep=ep) for ep in EP if lay.dp * lay.cp % ep == 0)
    return sorted(out, key=lambda l: (l.world, l.name))


def moe_refusal(layout: Layout) -> str | None:
    """The plan's verdict on ``layout`` for the MoE family (None: it runs)."""
    try:
        build_plan(config_for(layout, MOE_MODEL), layout.world)
    except ConfigError as e:
        return str(e)
    return None


def moe_expected_refusal(layout: Layout) -> str | None:
    """The documented reason an MoE layout cannot run (None: it must run): the dense family's
    (:func:`expected_refusal`), then the router's (each rank must see whole micro-batches or, under
    sequence / context parallelism, sum the router statistics over tp / cp), then expert
    parallelism's (carved out of dp x cp; on the plain runner with native DDP, native ZeRO-1/2/3 (HSDP
    with ep inside the shard group), torch DDP and FSDP2 without HSDP; on the native pipeline
    executor with native DDP and native ZeRO without HSDP; tp-replicated experts under tp, so far)."""
    why = expected_refusal(layout)
    if why:
        return why
    chunked = layout.schedule in CHUNKED_SCHEDULES or layout.schedule == "torch-interleaved"
    if layout.pp * (2 if chunked else 1) > MOE_MODEL["model.n_layer"]:
        return "the MoE model's 4 layers cannot fill pp x 2 model stages"
    if layout.ep > 1 and (layout.schedule == "threads" or layout.schedule in TORCH_KINDS):
        return "expert parallelism runs on the plain runner and the native pipeline executor"
    if layout.ep > 1 and layout.rep > 1 and (layout.dp // layout.rep * layout.cp) % layout.ep:
        return "expert parallelism under HSDP: ep must divide the shard degree dp / dp_replicate x cp"
    if layout.ep > 1 and layout.rep > 1 and layout.sync in ("fsdp2_2", "fsdp2_3"):
        return "expert parallelism under FSDP2's HSDP: the experts would need a 2-D mesh of their own"
    if layout.ep > 1 and layout.pp > 1 and (layout.rep > 1 or layout.sync in ("torch_ddp", "fsdp2_2", "fsdp2_3")):
        return "expert parallelism under a pipeline composes with native DDP and native ZeRO without HSDP so far"
    return None
