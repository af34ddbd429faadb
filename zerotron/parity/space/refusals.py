"""Which layouts of the parity matrix cannot run: the plan's verdict on each (:func:`refusal`) and the
documented reason (:func:`expected_refusal`); the matrix asserts the two agree in both directions."""
from __future__ import annotations

from zerotron.config import ConfigError
from zerotron.models.layout import a2a_refusal
from zerotron.plan import build_plan

from .layout import MODEL, MODELS, TORCH_KINDS, Layout, config_for


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
