"""The factors of the parity matrix, one :class:`Layout` (a value per factor) with its name and config
overrides, every layout of the factors' product, and the matrix model, training settings and config
of a layout (see the package docstring, ``zerotron.parity``)."""
from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
from dataclasses import dataclass

from zerotron.plan import CHUNKED_SCHEDULES

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
# the training settings of the LoRA witnesses (:data:`~zerotron.parity.space.witnesses.LORA`)
LORA_TRAIN = {"train.lora_rank": 4, "train.lr": 0.05}


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
