"""The parallel plan: every cross-feature rule and derived size of a run, in one place.

:func:`build_plan` turns a :class:`~zerotron.config_sections.Config` and a world size into a frozen
:class:`ParallelPlan`, once, before any process group or model exists. It is the only validation
layer: the per-field checks of the non-parallel sections (``config_checks.check_values``) and the layout
rules (``ParallelPlan.__post_init__``: a plan that exists is one the engine can run). The
strategies of ``zerotron.parallel`` take the plan, never the raw config, and do not re-check it.

What the plan derives (sources for the arithmetic in the docstrings of the properties):
``dp`` (from ``world_size / (tp * pp * cp)`` when ``parallel.dp = 0``), the HSDP split
``dp = dp_replicate x dp_shard``, the gradient accumulation ``grad_accum`` (micro-batches per
optimizer step per dp rank), the micro-batches per pipeline flush, the number of model stages
``pp * virtual_stages``, the *runner* (plain, pipeline, threads, torch) and the gradient
*synchroniser* (native DDP, torch DDP, native ZeRO-1/2/3, FSDP2, DTensor TP) it composes.

Pure Python (no torch import), so ``zerotron plan``/``memory`` and config checks stay cheap.

Modules: ``choices`` (allowed values), ``parallel_plan`` (the plan and its derived sizes), ``rules``,
``pipeline_rules``, ``model_rules`` (the layout rules, mixins of the plan), ``build`` (:func:`build_plan`).
Every name below is importable from here.
"""
from ..config_checks import check_values
from ..dims import ParallelDims
from .build import build_plan
from .choices import CHUNKED_SCHEDULES, CP_IMPLS, DTYPES, PP_SCHEDULES, REDUCE_DTYPES, RUNNERS, SYNCS
from .choices import DP_IMPLS as DP_IMPLS  # (not in __all__, as before)
from .parallel_plan import ParallelPlan

__all__ = ["ParallelDims", "ParallelPlan", "build_plan", "check_values", "DTYPES", "REDUCE_DTYPES",
           "PP_SCHEDULES", "CHUNKED_SCHEDULES", "RUNNERS", "SYNCS", "CP_IMPLS"]
