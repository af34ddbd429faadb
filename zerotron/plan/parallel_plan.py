"""The :class:`ParallelPlan`: a validated layout, its copied config sections read as attributes, and
the sizes derived from them (batch, accumulation, flush, model stages, runner, synchroniser). Its rules
are the mixins of ``plan.rules``, ``plan.pipeline_rules`` and ``plan.model_rules``."""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields

from ..config_sections import Config, ParallelConfig, TrainConfig
from ..dims import ParallelDims
from ..stages import Placement
from .choices import CHUNKED_SCHEDULES
from .model_rules import ModelRules
from .pipeline_rules import PipelineRules
from .rules import PlanRules

_PARALLEL_FIELDS = frozenset(f.name for f in fields(ParallelConfig))
_TRAIN_FIELDS = frozenset(f.name for f in fields(TrainConfig))
_DEGREES = ("dp", "tp", "pp", "dp_replicate", "cp")  # the plan's are its dims' (resolved), never the section's

# what a plan built directly (tests, inference) assumes for the train settings it is not given:
# one micro-batch of one sequence per dp rank and step, seed 0
_DIRECT_TRAIN = {"micro_batch": 1, "global_batch": 0, "seed": 0}


def _section_copy(section):
    """A private copy of a config section (a dataclass of scalars plus the ``_given`` set of
    ``config.apply``): what ``copy.deepcopy`` gives -- any value that is not an immutable scalar is
    deep-copied -- without its per-field memo walk (the parity matrix builds ~42,000 plans)."""
    new = copy.copy(section)
    for name, value in vars(section).items():
        if isinstance(value, (set, frozenset)) and all(isinstance(v, str) for v in value):
            new.__dict__[name] = type(value)(value)  # the names of ``_given``
        elif not isinstance(value, (bool, int, float, str, type(None))):
            new.__dict__[name] = copy.deepcopy(value)
    return new


@dataclass(frozen=True, init=False)
class ParallelPlan(PlanRules, PipelineRules, ModelRules):
    """A validated layout: what runs where, and the derived sizes. Built by :func:`build_plan`
    (from a config) or directly (tests, inference: only the settings that differ from the
    defaults, e.g. ``ParallelPlan(dims, pp_schedule="zb-v", virtual_stages=2)``).

    The plan keeps private copies of the config sections it reads -- ``parallel``
    (:class:`~zerotron.config_sections.ParallelConfig`) and ``train`` (:class:`~zerotron.config_sections.TrainConfig`)
    -- instead of re-declaring their fields: every setting of either section reads as an attribute
    of the plan (``plan.zero_stage``, ``plan.micro_batch``, same names and units as the config:
    ``bucket_mb`` in MiB, ``global_batch``/``micro_batch`` in sequences, ``global_batch = 0``
    meaning one micro-batch per dp rank per step), so a new setting is declared once, in
    ``config_sections.py``. The degrees are the resolved ``dims`` (``plan.dp`` is never the "0 = derive" of
    ``parallel.dp``). ``dropout`` is ``model.dropout``, ``doc_mask`` ``data.doc_mask``; ``shape`` is the resolved model shape
    (``config.model_shape``: n_layer, n_head, n_embd, block_size, + n_kv_head / intermediate_size
    for families that have them) or None when unknown (then the model-size rules are not checked;
    the strategies still refuse a split the model cannot take).

    Args: ``dims`` (default: one process), ``parallel``/``train`` (sections to copy; defaults: the
    config defaults, with ``micro_batch = 1, global_batch = 0, seed = 0`` for ``train``),
    ``dropout``, ``shape``, and any field of either section as a keyword, applied on top.

    Raises ConfigError (one line naming the setting and the fix) for every combination the engine
    cannot run: see the rules in ``__post_init__`` (the parity matrix, ``zerotron.parity``, asserts
    each refusal is the documented one); TypeError for a keyword that names no setting."""

    dims: ParallelDims
    parallel: ParallelConfig
    train: TrainConfig
    dropout: float
    shape: dict | None
    doc_mask: bool

    def __init__(self, dims: ParallelDims | None = None, *, parallel: ParallelConfig | None = None,
                 train: TrainConfig | None = None, dropout: float = 0.0, shape: dict | None = None,
                 doc_mask: bool = False, **fields):
        par = _section_copy(parallel) if parallel is not None else ParallelConfig()
        tr = _section_copy(train) if train is not None else TrainConfig(**_DIRECT_TRAIN)
        for name, value in fields.items():
            if name in _DEGREES:
                raise TypeError(f"ParallelPlan: the degrees come from dims, not {name}=: pass ParallelDims(...)")
            section = par if name in _PARALLEL_FIELDS else tr if name in _TRAIN_FIELDS else None
            if section is None:
                raise TypeError(f"ParallelPlan: {name!r} is not a parallel.* or train.* setting")
            setattr(section, name, value)
        for name, value in (("dims", dims if dims is not None else ParallelDims(1)), ("parallel", par),
                            ("train", tr), ("dropout", dropout), ("shape", shape), ("doc_mask", doc_mask)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __getattr__(self, name: str):
        """A setting of the copied ``parallel`` or ``train`` section (only reached for names that
        are not the plan's own attributes or properties)."""
        if not name.startswith("__"):
            for section, names in (("parallel", _PARALLEL_FIELDS), ("train", _TRAIN_FIELDS)):
                if name in names and section in self.__dict__:
                    return getattr(self.__dict__[section], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_config(cls, cfg: Config, dims: ParallelDims, shape: dict | None = None, **fields) -> "ParallelPlan":
        """The plan of ``cfg``'s parallel and train sections and model dropout on ``dims``, with
        ``fields`` on top (no :func:`check_values`: use :func:`build_plan` for a run). Raises
        ConfigError as the constructor does."""
        return cls(dims, parallel=cfg.parallel, train=cfg.train, dropout=cfg.model.dropout, shape=shape,
                   doc_mask=cfg.data.doc_mask, **fields)

    # ---- derived sizes -----------------------------------------------------------------------
    world_size = property(lambda self: self.dims.world_size, doc="processes in the run")
    dp = property(lambda self: self.dims.dp, doc="data-parallel degree")
    tp = property(lambda self: self.dims.tp, doc="tensor-parallel degree")
    pp = property(lambda self: self.dims.pp, doc="pipeline-parallel degree (processes per pipeline)")
    dp_replicate = property(lambda self: self.dims.dp_replicate, doc="HSDP replicas of the dp group")
    dp_shard = property(lambda self: self.dims.dp_shard, doc="HSDP shard-group size dp / dp_replicate")
    cp = property(lambda self: self.dims.cp, doc="context-parallel degree (each sequence split over cp ranks)")

    @property
    def batch(self) -> int:
        """Global batch in sequences (``global_batch``, or ``micro_batch * dp`` when 0)."""
        return self.global_batch or self.micro_batch * self.dp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step per dp rank: global_batch / (micro_batch * dp)."""
        return self.batch // (self.micro_batch * self.dp)

    @property
    def flush_size(self) -> int:
        """Micro-batches per pipeline flush (``microbatches``, or all of the step's when 0)."""
        return self.microbatches or self.grad_accum

    @property
    def runner(self) -> str:
        """plain (whole model per step) | pipeline (native executor, one process per stage) |
        threads (one process, a worker thread per stage) | torch (torch.distributed.pipelining)."""
        if self.pp_impl in ("threads", "torch"):
            return self.pp_impl
        return "pipeline" if self.pp > 1 or self.pp_schedule in CHUNKED_SCHEDULES else "plain"

    @property
    def n_model_stages(self) -> int:
        """Model stages the layers are split into: pp * virtual_stages for interleaved (Narayanan et
        al. 2021, interleaved 1F1B), zb-v (two per rank, in a V) or threads, pp otherwise."""
        return self.pp * (self.virtual_stages if self.pp_schedule in CHUNKED_SCHEDULES or self.runner == "threads" else 1)

    @property
    def placement(self) -> Placement:
        """Which pipeline rank holds which model stage (``zerotron.stages.Placement``): zb-v's V,
        else the loop (Megatron-LM's interleaving when virtual_stages > 1)."""
        return Placement.for_schedule(self.pp, self.pp_schedule, self.n_model_stages // self.pp)

    @property
    def collective_backend(self) -> str:
        """The process-group backend the run will use: ``backend`` when set, else NCCL on CUDA and
        gloo on CPU (``train.device``; for "auto" whether torch sees a CUDA device -- torch is
        imported only then, so a plan on an explicit device stays torch-free)."""
        if self.backend != "auto":
            return self.backend
        if self.device != "auto":
            return "nccl" if self.device == "cuda" else "gloo"
        import torch  # only for this question

        return "nccl" if torch.cuda.is_available() else "gloo"

    @property
    def sync(self) -> str:
        """The gradient synchroniser: ddp (native bucketed all-reduce) | torch_ddp | zero (native
        ZeRO-1/2/3, Rajbhandari et al. 2020) | fsdp2 (torch fully_shard) | dtensor_tp (torch's
        tensor parallelism alone, which reduces nothing over dp)."""
        if self.tp > 1 and self.tp_impl == "dtensor":
            return "dtensor_tp"
        if self.zero_stage:
            return "zero" if self.zero_impl == "native" else "fsdp2"
        return "ddp" if self.dp_impl == "native" else "torch_ddp"

    def layout(self) -> dict:
        """The record checkpoints keep (meta.json "layout"): the degree of every axis of
        ``zerotron.dims.AXES``, the combined dp degree and ``grad_accum``."""
        return {**self.dims.degrees, "dp": self.dp, "grad_accum": self.grad_accum}
