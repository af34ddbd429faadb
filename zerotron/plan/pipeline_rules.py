"""The pipeline rules of a :class:`~zerotron.plan.ParallelPlan` (a mixin): which runner composes with
which synchroniser, the schedules' sizes and virtual stages, and the layer split."""
from __future__ import annotations

from ..config import ConfigError
from ..stages import SPLIT_WORDS, stage_layer_counts
from .choices import _need


class PipelineRules:
    """``_check_pipeline`` of :class:`~zerotron.plan.ParallelPlan`; raises ConfigError naming the
    setting and the fix."""

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
