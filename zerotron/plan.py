"""The parallel plan: every cross-feature rule and derived size of a run, in one place.

:func:`build_plan` turns a :class:`~zerotron.config.Config` and a world size into a frozen
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
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields

from .config import Config, ConfigError, ParallelConfig, TrainConfig
from .config_checks import check_values
from .dims import ParallelDims
from .models.layout import a2a_refusal, lora_targets, tp_refusal
from .stages import SPLIT_WORDS, Placement, stage_layer_counts

__all__ = ["ParallelDims", "ParallelPlan", "build_plan", "check_values", "DTYPES", "REDUCE_DTYPES",
           "PP_SCHEDULES", "CHUNKED_SCHEDULES", "RUNNERS", "SYNCS", "CP_IMPLS"]

DTYPES = ("fp32", "bf16", "fp64")  # = parallel.precision.TRAIN_DTYPES (no torch import here)
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp64")
DP_IMPLS = ("native", "torch")
CP_IMPLS = ("ring", "a2a", "allgather")  # = parallel.context.attention.IMPLS (no torch import here)
PP_SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
# schedules that place parallel.virtual_stages model stages on each rank (Megatron-LM's loop; ZB-V's V)
CHUNKED_SCHEDULES = ("interleaved", "zb-v")
RUNNERS = ("plain", "pipeline", "threads", "torch")
SYNCS = ("ddp", "torch_ddp", "zero", "fsdp2", "dtensor_tp")


_PARALLEL_FIELDS = frozenset(f.name for f in fields(ParallelConfig))
_TRAIN_FIELDS = frozenset(f.name for f in fields(TrainConfig))
_DEGREES = ("dp", "tp", "pp", "dp_replicate", "cp")  # the plan's are its dims' (resolved), never the section's


def _need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# what a plan built directly (tests, inference) assumes for the train settings it is not given:
# one micro-batch of one sequence per dp rank and step, seed 0
_DIRECT_TRAIN = {"micro_batch": 1, "global_batch": 0, "seed": 0}


@dataclass(frozen=True, init=False)
class ParallelPlan:
    """A validated layout: what runs where, and the derived sizes. Built by :func:`build_plan`
    (from a config) or directly (tests, inference: only the settings that differ from the
    defaults, e.g. ``ParallelPlan(dims, pp_schedule="zb-v", virtual_stages=2)``).

    The plan keeps private copies of the config sections it reads -- ``parallel``
    (:class:`~zerotron.config.ParallelConfig`) and ``train`` (:class:`~zerotron.config.TrainConfig`)
    -- instead of re-declaring their fields: every setting of either section reads as an attribute
    of the plan (``plan.zero_stage``, ``plan.micro_batch``, same names and units as the config:
    ``bucket_mb`` in MiB, ``global_batch``/``micro_batch`` in sequences, ``global_batch = 0``
    meaning one micro-batch per dp rank per step), so a new setting is declared once, in
    ``config.py``. The degrees are the resolved ``dims`` (``plan.dp`` is never the "0 = derive" of
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
        par = copy.deepcopy(parallel) if parallel is not None else ParallelConfig()
        tr = copy.deepcopy(train) if train is not None else TrainConfig(**_DIRECT_TRAIN)
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

    # ---- the rules ---------------------------------------------------------------------------
    def __post_init__(self):
        self._check_settings()
        self._check_data_parallel()
        self._check_pipeline()
        self._check_context_parallel()
        self._check_tensor_parallel()
        self._check_doc_mask()
        self._check_experts()
        per_step = self.micro_batch * self.dp
        _need(self.batch % per_step == 0,
              f"train.global_batch ({self.batch}) must be divisible by train.micro_batch * dp "
              f"({self.micro_batch} * {self.dp} = {per_step}); gradient accumulation steps must be an integer")

    def _check_settings(self) -> None:
        """One setting at a time: allowed values."""
        _need(self.micro_batch >= 1 and self.global_batch >= 0,
              f"train.micro_batch must be >= 1 and train.global_batch >= 1, got {self.micro_batch}, {self.global_batch}")
        _need(self.dtype in DTYPES, f"train.dtype must be one of {DTYPES}, got {self.dtype!r}")
        _need(self.activation_checkpointing in ("none", "selective", "full"),
              f"train.activation_checkpointing must be none, selective or full, got {self.activation_checkpointing!r}")
        _need(self.dp_impl in DP_IMPLS, f"parallel.dp_impl must be one of {DP_IMPLS}, got {self.dp_impl!r}")
        _need(self.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _need(self.zero_impl in ("native", "fsdp2"), f"parallel.zero_impl must be native or fsdp2, got {self.zero_impl!r}")
        _need(self.reduce_dtype in REDUCE_DTYPES,
              f"parallel.reduce_dtype must be one of {REDUCE_DTYPES}, got {self.reduce_dtype!r}")
        _need(self.bucket_mb > 0 and math.isfinite(self.bucket_mb), f"parallel.bucket_mb must be > 0, got {self.bucket_mb}")
        _need(self.tp_impl in ("native", "dtensor"), f"parallel.tp_impl must be native or dtensor, got {self.tp_impl!r}")
        _need(self.pp_schedule in PP_SCHEDULES, f"parallel.pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        _need(self.microbatches >= 0,
              f"parallel.microbatches must be >= 0 (0 = all micro-batches of the step), got {self.microbatches}")
        _need(self.pp_impl in ("native", "threads", "torch"),
              f"parallel.pp_impl must be native, threads or torch, got {self.pp_impl!r}")
        _need(self.cp_impl in CP_IMPLS, f"parallel.cp_impl must be one of {CP_IMPLS}, got {self.cp_impl!r}")
        self._check_compile()

    def _check_compile(self) -> None:
        """What ``train.compile`` (regional compilation, ``parallel.compile``) cannot run on."""
        if not self.compile:
            return
        _need(self.tp_impl != "dtensor" or self.tp == 1,
              "train.compile does not compile parallel.tp_impl = dtensor (torch's DTensor TP path is left eager); "
              "use parallel.tp_impl = native or train.compile = false")
        _need(self.cp == 1,
              "train.compile does not run with parallel.cp > 1 (context parallel attention's collectives are not yet "
              "made opaque to the compiler, so their byte counters would recompile every call); set parallel.cp = 1 "
              "or train.compile = false")
        _need(self.pp_impl != "threads",
              "train.compile cannot run parallel.pp_impl = threads (torch.compile's frame hooks and caches are "
              "process-global, not thread-safe); use parallel.pp_impl = native or train.compile = false")
        _need(not self.doc_mask,
              "train.compile with data.doc_mask is not supported yet (the per-micro-batch document masks reach the "
              "attention outside the compiled block's inputs; untested under the compiler); set one of them false")
        _need(not (self.shape and self.shape.get("n_experts")),
              "train.compile with a mixture-of-experts model is not supported yet (the token-to-expert routing has "
              "data-dependent shapes: a recompile per routing); use train.compile = false")

    def _check_data_parallel(self) -> None:
        """Precision of the gradient reduction, ZeRO/FSDP2/DDP choices, HSDP."""
        z, impl = self.zero_stage, self.zero_impl
        _need(not (self.activation_checkpointing != "none" and self.dropout > 0 and self.tp > 1),
              "activation checkpointing with dropout > 0 and tp > 1 is not supported (the tensor-parallel RNG "
              "tracker is not replayed); set model.dropout = 0 or train.activation_checkpointing = none")
        _need(self.dtype != "fp64" or self.reduce_dtype in ("auto", "fp64"),
              f"train.dtype = fp64 reduces gradients in fp64; set parallel.reduce_dtype = auto (got {self.reduce_dtype!r})")
        _need(self.dtype == "fp64" or self.reduce_dtype != "fp64",
              "parallel.reduce_dtype = fp64 needs train.dtype = fp64; use auto, fp32 or bf16")
        _need(z > 0 or self.reduce_dtype != "bf16",
              "parallel.reduce_dtype = bf16 needs parallel.zero_stage >= 1 (without ZeRO, gradients are reduced in "
              "the parameter dtype); set parallel.reduce_dtype = auto or parallel.zero_stage = 1")
        _need(not (impl == "fsdp2" and z == 1),
              "parallel.zero_impl = fsdp2 supports zero_stage 2 (reshard_after_forward=False) or 3; use native for stage 1")
        _need(not (impl == "fsdp2" and z == 0),
              "parallel.zero_impl = fsdp2 is a ZeRO implementation and does nothing without a zero stage: set "
              "parallel.zero_stage = 2 or 3, or remove parallel.zero_impl")
        _need(self.offload in ("none", "optimizer", "optimizer-disk", "params"),
              f"train.offload must be none, optimizer, optimizer-disk or params, got {self.offload!r}")
        _need(self.offload != "params" or (z == 3 and impl == "native") or (z and impl == "fsdp2"),
              f"train.offload = params needs parameters sharded at rest: parallel.zero_stage = 3 (native) or "
              f"parallel.zero_impl = fsdp2 (CPUOffloadPolicy); {'DDP' if not z else f'ZeRO-{z}'} keeps the full "
              "parameters on every rank: set parallel.zero_stage = 3, or train.offload = optimizer")
        _need(self.offload == "optimizer-disk" or not self.offload_dir,
              f"train.offload_dir is used by train.offload = optimizer-disk only (offload is {self.offload!r}): "
              "remove train.offload_dir or set train.offload = optimizer-disk")
        _need(self.offload != "optimizer-disk" or self.offload_dir,
              "train.offload = optimizer-disk needs train.offload_dir, a folder on a local disk for the optimizer "
              "state files: set --train.offload_dir PATH")
        _need(self.offload in ("none", "params") or (z >= 1 and impl == "native"),
              f"train.offload = {self.offload} needs native ZeRO (parallel.zero_stage 1, 2 or 3 with "
              f"parallel.zero_impl = native): {'FSDP2' if impl == 'fsdp2' and z else 'torch DDP' if self.dp_impl == 'torch' else 'DDP'} keeps the "
              "optimizer "
              "state with its own buffers; set parallel.zero_stage = 1 (or 2, 3) and parallel.zero_impl = native, "
              "or train.offload = none")
        _need(not self.find_unused_parameters or (self.dp_impl == "torch" and z == 0),
              "parallel.find_unused_parameters applies to parallel.dp_impl = torch with zero_stage = 0 only (native "
              "DDP and ZeRO always skip parameters without gradient); remove it or set parallel.dp_impl = torch")
        if self.dp_replicate > 1:  # HSDP: native DDP / ZeRO, FSDP2 through its 2-D mesh; a pipeline natively
            _need(z > 0 or self.dp_impl == "native",
                  "parallel.dp_replicate > 1 needs parallel.dp_impl = native (hierarchical all-reduce) or a "
                  "parallel.zero_stage; torch DDP reduces over one flat group")
            _need(self.runner in ("plain", "pipeline"),
                  f"parallel.dp_replicate > 1 under pipeline parallelism runs on parallel.pp_impl = native (the "
                  f"{self.pp_impl} executor reduces over one flat group); set parallel.pp_impl = native or "
                  "parallel.dp_replicate = 1")
            _need(self.runner == "plain" or z == 0 or impl == "native",
                  "parallel.dp_replicate > 1 under pipeline parallelism runs with native DDP or native ZeRO (FSDP2's "
                  "2-D HSDP mesh is not split per stage); set parallel.zero_impl = native, parallel.dp_replicate = 1, "
                  "or parallel.pp = 1")

    def _check_pipeline(self) -> None:
        """Runner x synchroniser compositions, schedule sizes and the layer split."""
        pp, kind, impl = self.pp, self.pp_schedule, self.pp_impl
        interleaved, threads = kind == "interleaved", impl == "threads"
        n_acc = self.grad_accum if self.batch % (self.micro_batch * self.dp) == 0 else 0
        m_flush = self.microbatches or n_acc
        if impl == "torch":  # torch.distributed.pipelining schedules (parallel.pipeline.torch_backend)
            _need(pp >= 2, f"parallel.pp_impl = torch needs parallel.pp >= 2 (torch's schedules run one process per "
                           f"stage), got {pp}")
            _need(kind not in ("naive", "zb-v"), f"parallel.pp_impl = torch runs gpipe, 1f1b, interleaved or zb-h1, "
                                                 f"not {kind!r} (zb-v runs on pp_impl = native): set "
                                                 "parallel.pp_schedule to one of those, or parallel.pp_impl = native")
            _need(self.tp == 1 and self.zero_stage == 0 and self.dp_impl == "native",
                  "parallel.pp_impl = torch combines only with native DDP over dp: set parallel.tp = 1, "
                  "parallel.zero_stage = 0, parallel.dp_impl = native")
            _need(kind != "1f1b" or n_acc == 0 or m_flush >= pp,
                  f"parallel.pp_impl = torch with 1f1b needs micro-batches per flush ({m_flush}) >= pp "
                  f"({pp}) (torch's Schedule1F1B); lower train.micro_batch or use pp_impl = native")
        if threads:  # one process, one worker thread per stage (parallel.pipeline.threads)
            _need(pp == 1, f"parallel.pp_impl = threads runs every stage in one process (parallel.virtual_stages "
                           f"stage threads): set parallel.pp = 1, got {pp}")
            _need(kind == "gpipe", f"parallel.pp_impl = threads runs the GPipe schedule: set parallel.pp_schedule "
                                   f"= gpipe, got {kind!r}")
            _need(self.tp == 1 and self.zero_stage == 0 and self.dp_impl == "native",
                  "parallel.pp_impl = threads combines only with native DDP over dp: set parallel.tp = 1, "
                  "parallel.zero_stage = 0, parallel.dp_impl = native")
        if kind == "zb-v":
            _need(self.virtual_stages == 2,
                  f"parallel.pp_schedule = zb-v places two model stages per rank in a V (rank r holds stages r and "
                  f"2*pp-1-r): set parallel.virtual_stages = 2, got {self.virtual_stages}")
            # the executor posts a comm run as one batch on NCCL, whose sends then wait for their receives;
            # zb-v's order is deadlock-free only with sends that complete in the background (gloo)
            _need(pp == 1 or impl != "native" or self.collective_backend == "gloo",
                  "parallel.pp_schedule = zb-v runs on the gloo backend only (its order needs sends that complete "
                  "in the background), and this run uses nccl: use parallel.pp_schedule = zb-h1 (the same split "
                  "backward, one stage per rank)")
        elif interleaved or threads:
            _need(self.virtual_stages >= 2,
                  f"parallel.virtual_stages must be >= 2 for the interleaved schedule or pp_impl = threads (model "
                  f"stages per rank, or stage threads), got {self.virtual_stages}")
        else:
            _need(self.virtual_stages == 1,
                  f"parallel.virtual_stages ({self.virtual_stages}) applies only to the interleaved and zb-v schedules "
                  f"or pp_impl = threads: remove it, or set parallel.pp_schedule = interleaved")
        _need(pp > 1 or interleaved or kind == "zb-v" or threads or self.pp_split.strip() in SPLIT_WORDS,
              f"parallel.pp_split = {self.pp_split!r} splits layers over pipeline stages, but parallel.pp = 1: set "
              "parallel.pp > 1 or remove parallel.pp_split")
        if self.runner == "plain":
            return
        # implemented: pp x dp (native DDP, torch DDP per stage chunk, native ZeRO-1/2/3, FSDP2 ZeRO-2/3 per
        # pipeline rank) x tp (+ sequence parallel); torch DDP and FSDP2 per stage: parallel.pipeline.stage_sync
        _need(n_acc == 0 or n_acc % m_flush == 0,
              f"parallel.microbatches ({self.microbatches}) must divide the micro-batches per step per dp rank "
              f"(train.global_batch / (train.micro_batch * dp) = {n_acc})")
        _need(not interleaved or n_acc == 0 or m_flush % pp == 0,
              f"the interleaved schedule needs micro-batches per flush ({m_flush}) divisible by pp ({pp}); "
              "lower train.micro_batch or set parallel.microbatches to a multiple of pp")
        if self.shape is not None:
            try:  # "auto" has the feasibility rule of "even" (every stage >= 1 layer); its counts come from the model
                split = "even" if self.pp_split.strip() == "auto" else self.pp_split
                stage_layer_counts(self.shape["n_layer"], self.n_model_stages, split)
            except ValueError as e:
                raise ConfigError(f"parallel.pp_split / model.n_layer: {e}") from None

    def _check_context_parallel(self) -> None:
        """Context parallelism (``parallel.cp > 1``): the zigzag split of the sequence, the runners and
        features it composes with, and the all-to-all head rule (``models.layout.a2a_refusal``)."""
        cp = self.cp
        if cp == 1:
            return
        _need(self.runner in ("plain", "pipeline"),
              f"parallel.cp > 1 does not run with parallel.pp_impl = {self.pp_impl} (the {self.runner} runner "
              "reduces gradients over dp only); use parallel.pp_impl = native or parallel.cp = 1")
        if self.shape is None:
            return
        T = self.shape["block_size"]
        _need(T % (2 * cp) == 0,
              f"parallel.cp = {cp} needs model.block_size ({T}) divisible by 2*cp = {2 * cp} (each cp rank holds two "
              f"of 2*cp equal zigzag chunks of the training sequence); change model.block_size or parallel.cp")
        if self.cp_impl == "a2a":
            reason = a2a_refusal(cp, self.tp, self.shape)
            _need(reason is None, reason)

    def _check_doc_mask(self) -> None:
        """Document masking (``data.doc_mask``) needs a runner that hands each micro-batch's tokens to
        the attention of every stage (plain and the native pipeline executor) and attention that
        takes a mask (not torch's DTensor tensor parallelism)."""
        if not self.doc_mask:
            return
        _need(self.runner in ("plain", "pipeline"),
              f"data.doc_mask does not run with parallel.pp_impl = {self.pp_impl} (that runner does not pass each "
              "micro-batch's documents to its stages' attention); use parallel.pp_impl = native or data.doc_mask = false")
        _need(self.tp_impl == "native" or self.tp == 1,
              "data.doc_mask does not run with parallel.tp_impl = dtensor (torch's tensor parallelism; its attention "
              "takes no document mask); use parallel.tp_impl = native or data.doc_mask = false")

    def _check_tensor_parallel(self) -> None:
        """Head, kv-head, FFN and sequence divisibility; the DTensor comparison backend's limits."""
        tp = self.tp
        _need(tp > 1 or not self.sequence_parallel,
              "parallel.sequence_parallel shards activations along the sequence over the tp ranks and needs "
              "parallel.tp > 1: set parallel.tp, or remove parallel.sequence_parallel")
        _need(tp > 1 or self.tp_impl == "native",
              "parallel.tp_impl = dtensor chooses torch's tensor parallelism and needs parallel.tp > 1: set "
              "parallel.tp, or remove parallel.tp_impl")
        if self.tp_impl == "dtensor" and tp > 1:
            _need(self.dp == 1 and self.pp == 1 and self.cp == 1 and self.zero_stage == 0 and not self.sequence_parallel
                  and self.pp_schedule not in CHUNKED_SCHEDULES,
                  "parallel.tp_impl = dtensor (the torch comparison backend) runs tensor parallelism alone: dp = pp "
                  "= cp = 1, zero_stage = 0, sequence_parallel = false; use tp_impl = native to combine tp with the rest")
            _need(self.dropout == 0, "parallel.tp_impl = dtensor needs model.dropout = 0 (replicated-region "
                  "dropout masks would differ across tp ranks); use tp_impl = native for dropout")
        if self.shape is None:
            return
        s = self.shape  # heads, kv heads, MLP width, block_size under SP: the one rule (models.layout)
        # under cp, sequence parallelism splits this rank's T / cp tokens (cp outside tp)
        reason = tp_refusal(tp, s, s["block_size"] // self.cp if self.sequence_parallel else None)
        _need(reason is None, reason)


    def _check_experts(self) -> None:
        """Mixture-of-experts models (``shape["n_experts"]``) and expert parallelism (``parallel.ep``,
        carved out of the batch group dp x cp: ``zerotron.parallel.expert``). The router's auxiliary losses are taken over
        each micro-batch's tokens: under sequence (context) parallelism each tp (cp) rank routes its
        sequence shard and the statistics are summed over tp (cp) (``models.layout.add_token_sum``); capacity mode, which
        caps each forward's own assignments, is refused there rather than changing what is dropped."""
        ep, moe = self.ep, self.shape is not None and bool(self.shape.get("n_experts"))
        _need(isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1, f"parallel.ep must be an int >= 1, got {ep!r}")
        if moe:
            _need(not ((self.sequence_parallel or self.cp > 1) and self.shape.get("moe_capacity_factor")),
                  "model.moe_capacity_factor with parallel.sequence_parallel or parallel.cp > 1 is not supported (each "
                  "rank would cap the assignments of its sequence shard only); set model.moe_capacity_factor = 0 "
                  "(dropless), or parallel.sequence_parallel = false and parallel.cp = 1")
            _need(not (self.tp > 1 and self.tp_impl == "dtensor"),
                  "parallel.tp_impl = dtensor does not know the MoE layers; use parallel.tp_impl = native")
        if ep == 1:
            return
        _need(self.shape is None or moe,
              f"parallel.ep = {ep} splits the experts of a mixture-of-experts model, and this model has none; set "
              "model.arch = 'mixtral' or parallel.ep = 1")
        batch = self.dp * self.cp
        _need(batch % ep == 0,
              f"parallel.ep ({ep}) must divide the batch degree dp x cp ({self.dp} x {self.cp}): the ep group is carved "
              "out of the ranks holding different tokens of the batch; change parallel.ep or the world size")
        if moe:
            E = self.shape["n_experts"]
            _need(E % ep == 0, f"parallel.ep ({ep}) must divide model.n_experts ({E}): each ep rank holds E/ep whole "
                               "experts; change parallel.ep or model.n_experts")
        _need(self.runner in ("plain", "pipeline"),
              "parallel.ep > 1 runs on the plain runner and the native pipeline executor (parallel.pp_impl threads / "
              "torch do not shard experts); set parallel.pp_impl = native, or parallel.ep = 1")
        _need(self.dp_shard * self.cp % ep == 0,
              f"parallel.ep ({ep}) must divide the shard degree dp / dp_replicate x cp ({self.dp_shard} x {self.cp}) "
              "under HSDP: each ep group lies inside one shard group; change parallel.ep or parallel.dp_replicate")
        _need(self.dp_replicate == 1 or self.sync != "fsdp2",
              "parallel.ep > 1 with FSDP2's HSDP (parallel.dp_replicate > 1, zero_impl = fsdp2) is not supported (the "
              "experts would need a 2-D mesh of their own); set parallel.zero_impl = native (native HSDP runs "
              "with ep) or parallel.dp_replicate = 1")
        _need(self.runner == "plain" or (self.dp_replicate == 1 and self.sync in ("ddp", "zero")),
              "parallel.ep > 1 under a pipeline composes with native DDP and native ZeRO-1/2/3 without HSDP so far "
              "(torch DDP, FSDP2 and dp_replicate > 1 take experts on the plain runner only); set parallel.pp = 1, or "
              "parallel.dp_impl = native, parallel.zero_impl = native and parallel.dp_replicate = 1")


def _check_lora(t: TrainConfig, plan: ParallelPlan, arch: str) -> None:
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
    try:
        lora_targets(arch, t.lora_targets)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    _check_lora(cfg.train, plan, shape.get("arch", "gpt2"))
    if plan.runner == "plain" and p.microbatches:  # (a plan built directly may run PipelineStrategy at pp 1)
        raise ConfigError(f"parallel.microbatches ({p.microbatches}) sets the micro-batches per pipeline flush, "
                          "and this layout has no pipeline (parallel.pp 1): remove it, or set parallel.pp > 1, "
                          "the interleaved schedule or pp_impl = threads")
    return plan
