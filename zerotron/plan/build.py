"""The plan of a run: :func:`build_plan` (the per-setting checks, the plan of the config on a world
size, the LoRA rules and the micro-batch rule that need the whole config)."""
from __future__ import annotations

from ..config import ConfigError
from ..config_checks import check_values
from ..config_sections import Config, TrainConfig
from ..dims import ParallelDims
from ..models.layout import lora_targets, projection_widths
from .choices import _need
from .parallel_plan import ParallelPlan


def _check_lora(t: TrainConfig, plan: ParallelPlan, shape: dict) -> None:
    """LoRA settings and the layouts LoRA runs on: DDP, torch DDP, native ZeRO-1/2/3 and FSDP2
    (frozen base weights: no gradient, no sync, no optimizer state; ZeRO keeps them in their own
    flat buffers, sharded at stage 3), native tensor parallelism +- SP (adapters split like their
    base layer, ``parallel.tensor.adapters``) and the native runners (plain, pipeline). Refused:
    context parallelism (untested with adapters), DTensor TP (its plan does not know the adapters),
    the compiler (untested)."""
    _need(t.lora_rank >= 0, f"train.lora_rank must be >= 0 (0 = off), got {t.lora_rank}")
    if not t.lora_rank:
        return
    _need(not t.compile, "train.lora_rank with train.compile is not supported yet (the adapters are untested under "
                         "the compiler); set train.compile = false or train.lora_rank = 0")
    _need(t.lora_alpha >= 0, f"train.lora_alpha must be >= 0 (0 = 2 x rank), got {t.lora_alpha}")
    _need(0 <= t.lora_dropout < 1, f"train.lora_dropout must be in [0, 1), got {t.lora_dropout}")
    arch = shape.get("arch", "gpt2")
    try:
        paths = lora_targets(arch, t.lora_targets)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    widths = projection_widths(arch, shape)
    narrow = min(paths, key=lambda p: min(widths[p]))
    cap = min(widths[narrow])
    # a rank above min(in, out) adds parameters (more than the layer's own) and no expressive power:
    # a typo (e.g. 100000 on a 64-wide model) built adapters larger than the model without a word
    _need(t.lora_rank <= cap, f"train.lora_rank ({t.lora_rank}) exceeds the rank a LoRA update of {narrow} can have, "
                              f"min(in, out) = min{widths[narrow]} = {cap}: choose train.lora_rank <= {cap} "
                              "(typically 4-64), or train.lora_rank = 0 to train every weight")
    why = "LoRA (train.lora_rank > 0) runs with DDP, ZeRO/FSDP2, native tensor and pipeline parallelism; "
    _need(plan.tp == 1 or plan.tp_impl == "native", why + "parallel.tp_impl = dtensor does not split the adapters: "
                                                          "set parallel.tp_impl = native")
    _need(plan.cp == 1, why + "context parallelism is not tested with it: set parallel.cp = 1")
    _need(plan.runner in ("plain", "pipeline"), why + f"not the {plan.runner!r} pipeline runner: set "
                                                      "parallel.pp_impl = native")


def build_plan(cfg: Config, world_size: int) -> ParallelPlan:
    """The plan of ``cfg`` on ``world_size`` processes: :func:`check_values`, then a
    :class:`ParallelPlan` of the ``parallel`` section, the batch sizes, dtypes, recomputation,
    dropout, seed and the resolved model shape. Raises ConfigError naming the field and the fix
    (e.g. global_batch not divisible by micro_batch * dp)."""
    shape = check_values(cfg)
    p = cfg.parallel
    try:
        plan = ParallelPlan.from_config(cfg, ParallelDims(world_size, p.dp, p.tp, p.pp, p.dp_replicate, p.cp), shape)
    except ConfigError as e:
        if not cfg.model.init_from or "model." not in str(e):
            raise
        raise ConfigError(f"{e} (the model of model.init_from {cfg.model.init_from!r}, from its config.json)"
                          ) from None
    _check_lora(cfg.train, plan, shape)
    if plan.runner == "plain" and p.microbatches:  # (a plan built directly may run PipelineStrategy at pp 1)
        raise ConfigError(f"parallel.microbatches ({p.microbatches}) sets the micro-batches per pipeline flush, "
                          "and this layout has no pipeline (parallel.pp 1): remove it, or set parallel.pp > 1, "
                          "the interleaved schedule or pp_impl = threads")
    return plan
