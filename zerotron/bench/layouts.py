"""Layouts of ``zerotron bench train``: a name plus config overrides (:data:`LAYOUTS`), with
``-mbN`` / ``-acselective|-acfull`` / ``-even|-auto`` / ``-compile`` / ``-lora[N]`` / ``-p2pbatched|-p2peager`` suffixes
(:func:`get_layout`)."""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """``overrides``: ``{"section.field": value}``, ``"{world}"`` in a value -> N. ``world``: ranks
    used (None = all N). ``new_strategy``: a plain DataParallel/TorchDDP from ``parallelize`` means
    "not implemented yet" (skipped). ``all_threads``: N/world x the per-rank intra-op threads.
    ``p2p``: how the native pipeline executor posts its p2p ops (``pipeline.p2p.CommRunPoster``):
    None = its default (gloo: per op, the next run's receives early), "batched" (one
    batch_isend_irecv per comm run, no early receives: the NCCL path and the executor before early
    receives), "eager" (per op, no early receives); a benchmark knob, not a config field."""

    name: str
    overrides: dict = field(default_factory=dict)
    world: int | None = None
    new_strategy: bool = False
    all_threads: bool = False
    p2p: str | None = None


_NEW = dict(new_strategy=True)
LAYOUTS = {x.name: x for x in (
    Layout("dp", {"parallel.dp_impl": "native"}),
    Layout("dp-torch", {"parallel.dp_impl": "torch"}),
    Layout("single", {"parallel.dp_impl": "native"}, world=1),
    Layout("single-mt", {"parallel.dp_impl": "native"}, world=1, all_threads=True),
    *(Layout(f"zero{s}", {"parallel.zero_stage": s}, **_NEW) for s in (1, 2, 3)),
    *(Layout(f"fsdp2-zero{s}", {"parallel.zero_stage": s, "parallel.zero_impl": "fsdp2"}, **_NEW) for s in (2, 3)),
    # optimizer offload (train.offload): host memory, and the disk tier in $ZEROTRON_OFFLOAD_DIR (default: the temp dir)
    *(Layout(f"zero{s}-offload", {"parallel.zero_stage": s, "train.offload": "optimizer"}, **_NEW) for s in (1, 2, 3)),
    *(Layout(f"zero{s}-offdisk", {"parallel.zero_stage": s, "train.offload": "optimizer-disk",
                                  "train.offload_dir": os.environ.get("ZEROTRON_OFFLOAD_DIR", tempfile.gettempdir())},
             **_NEW) for s in (1, 2, 3)),
    # HSDP: 2 replicas (normally 2 nodes) x world/2 shards; "dp-hier": hierarchical DDP all-reduce
    *(Layout(f"hsdp-zero{s}", {"parallel.zero_stage": s, "parallel.dp_replicate": 2}, **_NEW) for s in (2, 3)),
    Layout("fsdp2-hsdp", {"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2", "parallel.dp_replicate": 2}, **_NEW),
    Layout("dp-hier", {"parallel.dp_impl": "native", "parallel.dp_replicate": 2}),
    Layout("tp", {"parallel.tp": "{world}"}, **_NEW),
    Layout("tp-sp", {"parallel.tp": "{world}", "parallel.sequence_parallel": "true"}, **_NEW),
    Layout("tp-dtensor", {"parallel.tp": "{world}", "parallel.tp_impl": "dtensor"}, **_NEW),
    *(Layout(f"pp-{k}", {"parallel.pp": "{world}", "parallel.pp_schedule": k}, **_NEW) for k in ("gpipe", "1f1b", "zb-h1")),
    Layout("pp-interleaved", {"parallel.pp": "{world}", "parallel.pp_schedule": "interleaved",
                              "parallel.virtual_stages": 2}, **_NEW),
    Layout("pp-zb-v", {"parallel.pp": "{world}", "parallel.pp_schedule": "zb-v", "parallel.virtual_stages": 2}, **_NEW),
    # torch.distributed.pipelining's schedules on the same split (parallel.pp_impl = torch)
    *(Layout(f"pp-torch-{n}", {"parallel.pp": "{world}", "parallel.pp_impl": "torch", "parallel.pp_schedule": k,
                               **({"parallel.virtual_stages": 2} if k == "interleaved" else {})}, **_NEW)
      for n, k in (("gpipe", "gpipe"), ("1f1b", "1f1b"), ("interleaved", "interleaved"), ("zb", "zb-h1"))),
    # context parallelism: each sequence split over 2 ranks (zigzag), attention by ring / all-to-all /
    # all-gather (parallel.cp_impl); dp-cp-ring: 2 data-parallel replicas x cp 2 (4 ranks)
    *(Layout(f"cp-{k}", {"parallel.cp": 2, "parallel.cp_impl": k}, world=2) for k in ("ring", "a2a", "allgather")),
    Layout("dp-cp-ring", {"parallel.dp": 2, "parallel.cp": 2, "parallel.cp_impl": "ring"}, world=4),
    # Mixtral-style MoE (8 experts, top-2) on the config's shape: data parallel (every expert on every rank)
    # vs expert parallel over all ranks (ep = N, carved out of dp = N; N must divide 8)
    Layout("moe-dp", {"model.arch": "mixtral", "model.n_experts": 8, "model.experts_top_k": 2}),
    Layout("moe-ep", {"model.arch": "mixtral", "model.n_experts": 8, "model.experts_top_k": 2,
                      "parallel.ep": "{world}"}),
    # one process, 2 stage threads (GPipe; the in-process executor), against pp-gpipe's 2 processes
    Layout("pp-threads-gpipe", {"parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe",
                                "parallel.virtual_stages": 2}, world=1, **_NEW),
)}
DEFAULT_LAYOUTS = "dp,dp-torch,single"


_SUFFIX = re.compile(r"-(mb)([1-9][0-9]*)$|-(ac)(selective|full)$|-(even|auto)$|-p2p(batched|eager)$|-(compile)$|-(lora)([1-9][0-9]*)?$")


def get_layout(name: str) -> Layout:
    """The :class:`Layout` of ``name``: a key of ``LAYOUTS`` followed by optional suffixes
    ``-mbN`` (``train.micro_batch = N``), ``-acselective`` / ``-acfull``
    (``train.activation_checkpointing``), ``-even`` / ``-auto`` (``parallel.pp_split``) and
    ``-compile`` (``train.compile = true``), ``-lora`` / ``-loraN`` (LoRA adapters of rank 8 / N on the
    default targets, ``train.lora_rank``), e.g. ``zero2-mb4-acfull``, ``pp-1f1b-even-mb2``, ``dp-compile``, ``dp-lora``; ``-p2pbatched`` / ``-p2peager`` set
    :attr:`Layout.p2p` (native pipeline layouts). Raises ValueError naming the valid layouts and
    suffixes."""
    base, extra, p2p = name, {}, None
    while (m := _SUFFIX.search(base)) and base[:m.start()]:
        if m.group(6):
            if p2p is not None:
                break
            p2p = m.group(6)
            base = base[:m.start()]
            continue
        key = "train.micro_batch" if m.group(1) else "train.activation_checkpointing" if m.group(3) \
            else "train.compile" if m.group(7) else "train.lora_rank" if m.group(8) else "parallel.pp_split"
        if key in extra:
            break
        extra[key] = "true" if m.group(7) else (m.group(9) or "8") if m.group(8) else m.group(2) or m.group(4) or m.group(5)
        base = base[:m.start()]
    if base not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; valid layouts: {', '.join(LAYOUTS)}, each optionally "
                         "followed by -mbN (micro-batch), -acselective|-acfull (activation checkpointing), -even|-auto "
                         "(parallel.pp_split), -compile (train.compile), -lora|-loraN (train.lora_rank, default 8) and "
                         "-p2pbatched|-p2peager (pipeline executor p2p posting)")
    lay = LAYOUTS[base]
    if p2p is not None and (not base.startswith("pp-") or base.startswith(("pp-torch", "pp-threads"))):
        raise ValueError(f"layout {name!r}: -p2p{p2p} applies to the native multi-process pipeline layouts "
                         "(pp-gpipe, pp-1f1b, pp-zb-h1, pp-zb-v, pp-interleaved) only")
    return lay if not extra and p2p is None else Layout(name, {**lay.overrides, **extra}, lay.world, lay.new_strategy,
                                                        lay.all_threads, p2p)


def parse_layouts(spec: str) -> list[str]:
    """Layout names of a comma list, unique, in order (:func:`get_layout` syntax). Raises
    ValueError naming the valid layouts."""
    names = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    bad = []
    for n in names:
        try:
            get_layout(n)
        except ValueError as e:
            if not str(e).startswith("unknown layout"):
                raise  # a known layout with a suffix it does not take: that message
            bad.append(n)
    if bad or not names:
        raise ValueError(f"unknown layout(s) {', '.join(bad) or repr(spec)}; valid layouts: {', '.join(LAYOUTS)} "
                         "(each optionally followed by -mbN, -acselective|-acfull, -even|-auto, -compile, -lora[N] and "
                         "-p2pbatched|-p2peager)")
    return names
