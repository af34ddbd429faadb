"""The rules of a :class:`~zerotron.plan.ParallelPlan` (a mixin): the order they run in when a plan
is made, the allowed value of each setting, what ``train.compile`` cannot run on, and the data-parallel
rules (reduction precision, ZeRO / FSDP2 / DDP choices, offload, HSDP)."""
from __future__ import annotations

import math

from .choices import CP_IMPLS, DP_IMPLS, DTYPES, PP_SCHEDULES, REDUCE_DTYPES, _need


class PlanRules:
    """``__post_init__`` (every rule, in order) and the setting, compile and data-parallel rules of
    :class:`~zerotron.plan.ParallelPlan`; each raises ConfigError naming the setting and the fix."""

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
