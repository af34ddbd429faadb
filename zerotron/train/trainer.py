"""The training run: set-up (process group, mesh, data, model, strategy, optimizer), the step loop,
evaluation, checkpoints, metrics, and the end-of-run summary, plot and sample."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..config import Config, ConfigError
from ..data import GlobalBatchSampler, batch_from_indices, num_windows
from ..distributed import comm
from ..distributed.mesh import Mesh, init_distributed
from ..models import registry
from ..models.mixtral import set_step_rows, take_router_stats, update_expert_bias
from ..parallel import parallelize
from ..parallel.compile import compile_stats, use_cache_dir
from ..parallel.context.docmask import apply_doc_mask
from ..parallel.context.split import split_sequence
from ..parallel.precision import param_dtype
from ..plan import ParallelPlan, build_plan
from . import checkpoint as ckpt
from . import lifecycle
from .checkpoint import background as ckpt_background
from .metrics import TRAIN_DTYPES, MetricsWriter, MFUMeter, peak_flops, plot_losses, read_metrics
from .optim import build_scheduler
from .progress import Progress
from .run_log import MetricsLog, write_summary
from .setup import (
    check_init_vocab,
    check_resume,
    check_run_dir,
    gpt_config,
    load_data,
    pad_rows,
    padding_batch,
    train_device,
    val_rank_windows,
)
from .step import IGNORE_INDEX, evaluate, train_step
from .tensorboard import open_tensorboard
from .wandb_log import open_wandb


def _bytes_by_op(before: dict) -> dict:
    """Bytes per "op/group" moved since the snapshot ``before`` of ``comm.STATS.bytes``."""
    out = {}
    for (op, group, _tag), b in comm.STATS.bytes.items():
        d = b - before.get((op, group, _tag), 0)
        if d:
            out[f"{op}/{group}"] = out.get(f"{op}/{group}", 0) + d
    return out


class Trainer:
    """Owns one run. ``Trainer(cfg, run_dir, resume).fit()`` trains ``train.steps`` optimizer steps.

    ``restart`` (``restarts.restart_count()``): this is a restarted attempt of a run whose worker
    died; with ``resume`` it continues from the newest good checkpoint, without one it starts from
    step 0 and replaces the metrics (and TensorBoard events) the failed attempt wrote.

    ``plan`` (the ``ParallelPlan`` of ``cfg`` for this world size) and ``resume_from`` (the
    checkpoint directory ``train.setup.check_resume`` chose) are what ``zerotron train`` decided
    before anything was written; each process builds the plan and checks a resume once, there.
    A library caller may leave them out: the Trainer then builds and checks them itself. Raises
    ValueError for a plan of another world size.

    ``mesh``: a :class:`~zerotron.distributed.mesh.Mesh` of the plan's dims built earlier in this
    process group, whose process groups this run then uses instead of building its own (the parity
    matrix trains hundreds of layouts of a few mesh shapes in one spawn); None builds one. Raises
    ValueError for a mesh of other dims.

    Must run inside every worker process (torchrun/``--nproc``) or alone (world size 1)."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, restart: int = 0,
                 plan: ParallelPlan | None = None, resume_from: Path | None = None, mesh: Mesh | None = None):
        self.cfg, self.run_dir, self.resume, self.restart = cfg, Path(run_dir), resume, restart
        if resume:  # ``zerotron train`` passes the verdict of its one check; a library caller gets it here
            self.resume_from = resume_from or check_resume(cfg, self.run_dir, quarantine=False)
        rank, world, device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, train_device(cfg))
        if not resume and not restart:  # a fresh run never writes over one (the CLI checks first too)
            self._refuse_existing_run(device)
        if plan is None:  # every layout rule, once per process: ``zerotron train`` built it before any write
            plan = build_plan(cfg, world)
        elif plan.dims.world_size != world:
            raise ValueError(f"the plan is for world size {plan.dims.world_size}, this process group has {world}")
        self.plan = plan  # the strategies take the plan
        self.layout = self.plan.layout()
        if mesh is not None and mesh.dims != self.plan.dims:
            raise ValueError(f"the mesh is for {mesh.dims}, the plan needs {self.plan.dims}")
        self.mesh = mesh if mesh is not None else Mesh(self.plan.dims, device)
        self.device, self.rank, self.world = device, rank, world
        self.dp_rank, self.dp = self.mesh.local_rank("dp"), self.mesh.size("dp")
        self.cp_rank, self.cp = self.mesh.local_rank("cp"), self.mesh.size("cp")
        self.data = load_data(cfg, int(os.environ.get("LOCAL_RANK", 0)))
        torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
        if cfg.model.init_from:
            self.model = self._from_hf(cfg.model.init_from).to(device)
            self.model_cfg = self.model.config
        else:
            self.model_cfg = gpt_config(cfg, self.data.vocab_size)
            if cfg.train.meta_init and not cfg.train.lora_rank:  # parallelize materialises this rank's part
                from ..models.deferred import build_deferred

                self.model = build_deferred(lambda: registry.build_model(self.model_cfg), device)
            else:
                self.model = registry.build_model(self.model_cfg).to(device)
        self.model.to(dtype=param_dtype(cfg.train.dtype))  # fp64 mode: every parameter in float64
        if cfg.train.lora_rank:  # base frozen, adapters trained (the plan checked the layout and targets)
            from ..models.lora import apply_lora, lora_kwargs

            apply_lora(self.model, registry.arch_of(self.model), **lora_kwargs(dataclasses.asdict(cfg.train)))
        self.seq_len = self.model_cfg.block_size
        self.num_params = self.model.num_params()  # dense count, before any sharding
        dense = self.model.state_dict()  # dense, before any sharding: what a checkpoint holds once
        self.state_bytes, self.state_tensors = sum(v.numel() * v.element_size() for v in dense.values()), len(dense)
        set_step_rows(self.model, cfg.train.global_batch, cfg.train.micro_batch)  # MoE: aux-loss weight b / global_batch, per micro-batch
        if cfg.train.compile:  # before the first compile: the ranks and a resumed run share Inductor's cache
            use_cache_dir(str(self.run_dir / "inductor_cache"))
        self.strategy = parallelize(self.model, self.plan, self.mesh)
        if cfg.data.doc_mask:  # outermost hooks; every runner wraps each micro-batch in its documents
            self.strategy.documents = apply_doc_mask(self.model, self.data.eot_id).documents
        self.optimizer = self.strategy.build_optimizer(cfg.train, self.strategy.decay_mask)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.sampler = GlobalBatchSampler(num_windows(len(self.data.train), self.seq_len),
                                          cfg.train.global_batch, cfg.train.seed)
        n_val = num_windows(len(self.data.val), self.seq_len)
        val_idx = GlobalBatchSampler.val_indices(n_val, cfg.train.eval_batches * cfg.train.global_batch)
        # the same number of eval forwards on every dp rank (padding batches count no token)
        val_groups = val_rank_windows(val_idx, self.dp_rank, self.dp, cfg.train.micro_batch)
        self.val_windows = np.concatenate(val_groups)  # this rank's windows, each once
        self.val_batches = [self._cp_local(batch_from_indices(self.data.val, g, self.seq_len, "val", self.data.val_mask,
                                                              IGNORE_INDEX) if len(g)
                                           else padding_batch(self.seq_len)) for g in val_groups]
        if cfg.train.compile:  # one static evaluation shape: no recompile for a short or padding batch
            self.val_batches = [pad_rows(b, cfg.train.micro_batch) for b in self.val_batches]
        self.start_step = 0
        self.failed_saves: list[int] = []  # steps whose checkpoint could not be written (on_error = continue)
        self.unsaved: int | None = None    # the newest of them, while no later save has succeeded
        self.ckpt_blocked_s = 0.0          # seconds the latest save blocked training
        self.saver = ckpt_background.AsyncSaver(self.strategy) if cfg.checkpoint.async_save else None  # collective
        torch.manual_seed(cfg.train.seed + 1 + rank)  # per-rank stream for dropout
        if resume:
            latest = self.resume_from
            meta = ckpt.load_checkpoint(latest, self.strategy, self.optimizer, self.scheduler)
            self.start_step = meta["step"]
            if rank == 0:
                again = f"restart {restart}: " if restart else ""
                print(f"zerotron: {again}resumed from {latest} (step {self.start_step})", flush=True)
                was = meta.get("config", {}).get("train", {}).get("steps")
                if was is not None and was != cfg.train.steps:
                    print(f"zerotron: train.steps {was} -> {cfg.train.steps}: the learning-rate schedule is "
                          "recomputed for the new length (not equal to an uninterrupted run)", flush=True)
            if meta.get("model_config", {}).get("vocab_size", self.model_cfg.vocab_size) != self.model_cfg.vocab_size:
                raise ConfigError("--resume: the vocabulary size differs from the checkpoint's; keep data.* and "
                                  "model.vocab_size as they were")
            # the LR of the next step from the *current* schedule (train.steps may have been raised)
            sch = self.scheduler
            for g, base, fn in zip(self.optimizer.param_groups, sch.base_lrs, sch.lr_lambdas):
                g["lr"] = base * fn(sch.last_epoch)
        from ..analysis.flops import shape_of, training_flops_per_token

        # N of 6N: the matmul parameters (an untied Llama embedding is a lookup; GPT-2: num_params)
        self.flops_per_token = training_flops_per_token(shape_of(self.model_cfg).flop_params(),
                                                        self.model_cfg.n_layer, self.model_cfg.n_embd, self.seq_len)
        local_peak, source = peak_flops(device, TRAIN_DTYPES[cfg.train.dtype])  # cached per process
        peak = torch.tensor([local_peak], dtype=torch.float64, device=device)
        comm.all_reduce(peak, tag="setup")
        self.peak_flops_total = float(peak)
        self.mfu_meter = MFUMeter(self.flops_per_token, world, self.peak_flops_total / world, device,
                                  TRAIN_DTYPES[cfg.train.dtype], warn=rank == 0, source=source)

    def _router_metrics(self) -> dict:
        """MoE models: the step's router statistics summed over dp and pp (tp and cp ranks hold copies); moves
        the auxiliary-loss-free balancing bias by the step's global load (``update_expert_bias``) -> ``moe_aux_loss``, ``moe_z_loss`` (means over layers and micro-batches, before
        their weights), ``moe_load_max_mean`` (max / mean assignments per expert, per layer) and its
        mean over layers ``moe_load_max_mean_avg``; with a capacity, ``moe_dropped`` (assignments
        dropped over capacity this step, all layers) and ``moe_dropped_frac``; {} for a dense model."""
        cfg = self.model_cfg
        dropped = torch.zeros(cfg.n_layer, 1, dtype=torch.float64)
        stats = take_router_stats(self.model, cfg.n_layer, getattr(cfg, "n_experts", 0), dropped[:, 0])
        if stats is None:
            return {}
        stats = torch.cat([stats, dropped], dim=1)  # one reduction for both
        for axis in ("dp", "pp"):  # cp and SP ranks already summed their shards (MoE.token_sum): copies
            if self.mesh.size(axis) > 1:
                comm.all_reduce(stats, group=self.mesh.group(axis), tag="metrics")
        counts = stats[:, :-3]
        update_expert_bias(self.model, counts)  # the global load: every layout moves the bias alike
        load = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)).tolist()
        out = {"moe_aux_loss": float(stats[:, -3].mean()), "moe_z_loss": float(stats[:, -2].mean()),
               "moe_load_max_mean": load, "moe_load_max_mean_avg": sum(load) / len(load)}
        if getattr(cfg, "moe_capacity_factor", 0):
            out["moe_dropped"] = int(stats[:, -1].sum())  # assignments over capacity, all layers, this step
            out["moe_dropped_frac"] = float(stats[:, -1].sum() / counts.sum().clamp_min(1))
        return out

    def _from_hf(self, path):
        """Dense model with the family, shape and weights of a HF GPT-2 or Llama checkpoint
        (dropout from the config). Raises ConfigError if its vocabulary is smaller than the
        tokenizer's."""
        hf = registry.load_hf(path)
        check_init_vocab(hf.config.vocab_size, self.data.vocab_size)
        model = registry.build_model(dataclasses.replace(hf.config, dropout=self.cfg.model.dropout))
        model.load_state_dict(hf.state_dict())
        return model

    def _cp_local(self, batch):
        """This cp rank's part of a batch ``(x, y)``: both (b, T) -> (b, T / cp), the zigzag chunks
        of ``parallel.context.split`` (the targets of the local tokens; unchanged without cp)."""
        x, y = batch
        return split_sequence(x, self.cp, self.cp_rank), split_sequence(y, self.cp, self.cp_rank)

    def _chunks(self, indices, tokens, mask=None):
        mb = self.cfg.train.micro_batch
        return [self._cp_local(batch_from_indices(tokens, indices[i:i + mb], self.seq_len, "train", mask, IGNORE_INDEX))
                for i in range(0, len(indices), mb)]

    def micro_batches(self, step: int):
        """This rank's micro-batches of optimizer step ``step``: list of (x, y), each (micro_batch, T)
        (T / cp: this cp rank's zigzag chunks under context parallelism)."""
        return self._chunks(self.sampler.local_indices(step, self.dp_rank, self.dp), self.data.train,
                            self.data.train_mask)

    def meta(self, step: int) -> dict:
        return {"config": self.cfg.to_dict(), "world_size": self.world, "layout": self.layout,
                "tokens_seen": step * self.cfg.train.global_batch * self.seq_len,
                "model_config": registry.config_meta(self.model_cfg)}

    def expected_checkpoint_bytes(self) -> int:
        """Estimated bytes of a checkpoint, for the free-space check of the first save (later ones
        use the previous checkpoint's size): the dense state dict three times (weights and AdamW's
        two moments), 2 KiB of file and index overhead per saved tensor, the tokenizer, 16 KiB of
        RNG state per rank and 64 KiB for the rest (tiny model: 6% above the real size)."""
        tok = self.data.tokenizer_path
        tok_bytes = os.path.getsize(tok) if tok and os.path.isfile(tok) else 0
        return 3 * self.state_bytes + 3 * 2048 * self.state_tensors + tok_bytes + 16384 * self.world + 65536

    def next_save(self, step: int) -> int | None:
        """The step of the first save after ``step`` (checkpoint.every / save_final), or None."""
        every, steps = self.cfg.checkpoint.every, self.cfg.train.steps
        if every and (step // every + 1) * every <= steps:
            return (step // every + 1) * every
        return steps if self.cfg.checkpoint.save_final and step < steps else None

    def save(self, step: int, must: str = "") -> Path | None:
        """Collectively write checkpoint ``step``; returns its directory. Sets :attr:`ckpt_blocked_s`
        (the seconds this call kept training from going on).

        With ``checkpoint.async_save`` and no ``must``, the state is staged into host memory and
        written by a background thread (``checkpoint.background``); the call first waits for a
        pending save (at most one in flight), whose failure is handled here as below, and returns
        the directory the new checkpoint will have once written. A ``must`` save (and every save
        without ``async_save``) is written before the call returns, after any pending one.

        A save refused by the free-space check or failed while writing (the partial directory is
        removed, the previous checkpoints are kept): with ``checkpoint.on_error = continue`` and no
        ``must``, rank 0 prints one warning line, the step is recorded in :attr:`failed_saves`
        (:attr:`unsaved` until a later save succeeds) and None is returned on every rank (the
        failure is agreed collectively, so all ranks go on together). Otherwise, or when ``must``
        says why this save cannot be skipped ("final": the end of training; "signal": a stop on a
        signal), raises lifecycle.RunStopped (exit 3) on every rank. A non-finite parameter
        always raises RunStopped."""
        t0 = time.perf_counter()
        self.ckpt_blocked_s = 0.0
        try:
            self.finish_pending()
            if not lifecycle.params_finite(self.strategy, self.device):
                raise lifecycle.RunStopped(f"refusing to write checkpoint step_{step}: a parameter is not finite; "
                                           f"the newest good checkpoint is {ckpt.latest_checkpoint(self.run_dir)}")
            args = (self.run_dir, step, self.strategy, self.optimizer, self.scheduler, self.meta(step),
                    self.data.tokenizer_path)
            opts = {"keep": self.cfg.checkpoint.keep, "expected_bytes": self.expected_checkpoint_bytes()}
            if self.saver is not None and not must:
                self.saver.start(*args, **opts)
                return self.run_dir / "checkpoints" / f"step_{step}"
            try:
                path = ckpt.save_checkpoint(*args, **opts)
                self.unsaved = None
                return path
            except ckpt.CheckpointWriteError as e:
                return self._save_failed(step, must, e)
        finally:
            self.ckpt_blocked_s = time.perf_counter() - t0

    def finish_pending(self) -> Path | None:
        """Wait for the pending background save (``checkpoint.async_save``), if any; returns its
        directory, or None when there was none or it failed (handled as :meth:`save` handles a
        failed save without ``must``: a warning, or RunStopped with ``on_error = stop``)."""
        if self.saver is None or not self.saver.pending:
            return None
        step = self.saver.pending_step
        path, err, _ = self.saver.wait()
        if err is None:
            self.unsaved = None
            return path
        if isinstance(err, ckpt.CheckpointWriteError):
            return self._save_failed(step, "", err)
        raise err

    def _save_failed(self, step: int, must: str, e: Exception) -> None:
        """The outcome of a failed save of ``step`` (see :meth:`save`): None, or RunStopped."""
        self.failed_saves.append(step)  # (summary.json lists it also when the run stops here)
        if must or self.cfg.checkpoint.on_error == "stop":
            why = {"final": f"the final checkpoint (step {step} of {self.cfg.train.steps}) could not be written",
                   "signal": "the run was stopping on a signal",
                   "metrics": f"{self._metrics_error()} (checkpoint.on_error = stop)"
                   }.get(must, "checkpoint.on_error = stop")
            cks = ckpt.list_checkpoints(self.run_dir)
            newest, lost = bool(cks), step - (cks[-1][0] if cks else 0)
            raise lifecycle.RunStopped(f"{e}; stopped: {why}; the last {lost} steps are not saved; free disk "
                                       f"space, then " + (f"resume with: {lifecycle.resume_command()}" if newest
                                                          else self._start_again())) from None
        self.unsaved = step
        if self.rank == 0:
            nxt = self.next_save(step)
            print(f"zerotron: warning: {e}; training continues (checkpoint.on_error = continue), "
                  + (f"the next save at step {nxt} retries" if nxt else "no later save is scheduled"),
                  file=sys.stderr, flush=True)
        return None

    def _log_blocked(self, writer) -> None:
        """Add ``ckpt_blocked_s`` (and ``ckpt_async``) of the save just made to the step's record
        in metrics.jsonl (rank 0)."""
        if writer is not None:
            writer.amend({"ckpt_blocked_s": self.ckpt_blocked_s,
                          "ckpt_async": self.saver is not None and self.saver.pending})

    def _metrics_error(self) -> str:
        """What failed on rank 0's metrics.jsonl (the line only rank 0 prints)."""
        log = getattr(self, "metrics_log", None)
        return str(log.error) if log is not None and log.error is not None else "metrics.jsonl could not be written"

    def _start_again(self) -> str:
        """The fix for a run that stopped without any checkpoint: its metrics.jsonl stays, so the same
        --run-dir is refused (``setup.check_run_dir``); a new one, or this one deleted, starts over."""
        return f"start again with a new --run-dir (or delete {str(self.run_dir)!r} first)"

    def _metrics_stop(self, step: int, saved: Path) -> lifecycle.RunStopped:
        """The exit-3 stop after a failed metrics.jsonl append (checkpoint.on_error = stop), once
        checkpoint ``saved`` of ``step`` is written."""
        log, what = getattr(self, "metrics_log", None), self._metrics_error()
        if log is not None:
            log.close()  # the held records, if the checkpoint attempt left room for them
        held = log.held() if log is not None else ""
        lost = f"; the records of {held} are not in metrics.jsonl" if held else ""
        if step == self.cfg.train.steps:  # nothing left to resume
            return lifecycle.RunStopped(f"{what}; training finished at step {step} and its checkpoint is written "
                                        f"({saved}), but metrics.jsonl could not be written (checkpoint.on_error = "
                                        f"stop){lost}")
        return lifecycle.RunStopped(f"{what}; stopped at step {step} (checkpoint.on_error = stop), "
                                    f"checkpoint written ({saved}){lost}; free disk space, then resume with: "
                                    f"{lifecycle.resume_command()}")

    def _refuse_existing_run(self, device) -> None:
        """ConfigError on every rank if ``run_dir`` already holds a run (metrics or checkpoints).
        The verdict is all-reduced before any rank writes, so no rank can see a file another rank
        of this run just created, and all ranks stop together."""
        try:
            check_run_dir(self.run_dir, False)
            found = None
        except ConfigError as e:
            found = e
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            flag = torch.tensor([0.0 if found is None else 1.0], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() and found is None:
                found = ConfigError(f"run directory {str(self.run_dir)!r} already holds a run on another rank; "
                                    "pass resume=True to continue it, or choose a new run directory")
        if found is not None:
            raise found

    def fit(self, callback=None) -> dict:
        """Train from ``start_step`` to ``train.steps``; returns a summary dict (rank 0 meaningful).

        ``callback(trainer, record)`` is called on every rank after each optimizer step (tests use it
        to check that replicas stay identical). Rank 0 writes metrics.jsonl (a failed append is
        held, see ``run_log.MetricsLog``) and, however the run ends, summary.json (with
        ``stopped`` and ``exit_code`` when lifecycle.RunStopped ends it). RunStopped is raised on
        every rank together, except for metrics records still unwritten at the end (rank 0 only).
        A Trainer fits once: RuntimeError on a second call (it would write the run's metrics
        again); build a new one with ``resume=True`` to go on."""
        if getattr(self, "_fitted", False):
            raise RuntimeError("Trainer.fit() was already called on this trainer; build a new "
                               "Trainer(cfg, run_dir, resume=True) to continue the run")
        self._fitted = True
        cfg, t = self.cfg, self.cfg.train
        lead = self.rank == 0
        if self.start_step >= t.steps:
            if lead:
                print(f"zerotron: the run is already at step {self.start_step} (train.steps = {t.steps}); "
                      "raise --train.steps to continue it")
            return {"steps": self.start_step, "final_loss": None, "first_val_loss": None, "final_val_loss": None,
                    "median_tokens_per_s": None, "nothing_to_do": True}
        keep_to = self.start_step if self.resume or self.restart else None  # metrics of steps <= this are kept
        wb = open_wandb(cfg.log.wandb, cfg.log.wandb_project, self.run_dir, cfg.to_dict(), lead)  # first: a missing package stops here
        writer = MetricsLog(MetricsWriter(self.run_dir / "metrics.jsonl", keep_to), cfg.checkpoint.on_error) \
            if lead else None
        self.metrics_log = writer
        if lead:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        bar = Progress(t.steps, self.start_step, cfg.log.every) if lead and cfg.log.progress else None
        tb = open_tensorboard(cfg.log.tensorboard, self.run_dir, keep_to, lead)
        die_at = lifecycle.fault_kill_step()  # fault injection for tests (per restart attempt)
        die_rank = int(os.environ.get("ZEROTRON_FAULT_KILL_RANK", "0"))  # which rank kill -9s itself
        tok_per_step = t.global_batch * self.seq_len
        first_val = last_val = None
        signals = lifecycle.GracefulStop(t.stop_grace_s, announce=lead)  # installed for the loop only
        guard = lifecycle.StepGuard(t.nonfinite, t.nonfinite_limit, signals, self.rank, self.device)
        if lead and self.resume and (self.run_dir / "metrics.jsonl").exists():
            old = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if r.get("step", 0) <= self.start_step]
            first_val = next((r["val_loss"] for r in old if r.get("val_loss") is not None), None)
            guard.skipped = old[-1].get("skipped_steps", 0) if old else 0
        rates, losses = [], []
        reached = self.start_step
        io_stop = cfg.checkpoint.on_error == "stop"  # a failed metrics.jsonl append stops every rank

        def summary_now(**extra) -> dict:
            return {"steps": reached, "final_loss": losses[-1] if losses else None, "first_val_loss": first_val,
                    "final_val_loss": last_val, "median_tokens_per_s": statistics.median(rates) if rates else None,
                    "skipped_steps": guard.skipped, "failed_checkpoints": self.failed_saves, **extra}
        self.model.train()
        signals.install()
        try:  # the loggers are closed (flushed) also when a guard or a signal stops the run
            for step in range(self.start_step, t.steps):
                batches = self.micro_batches(step)
                before = dict(comm.STATS.bytes)
                t0 = time.perf_counter()
                guard.step = step + 1
                comm.set_step(step + 1)  # named by the watchdog if a collective of this step fails
                out = train_step(self.strategy, self.optimizer, self.scheduler, batches, self.mesh.group("batch"),
                                 t.grad_clip, t.dtype, self.device, guard=guard)
                dt = time.perf_counter() - t0
                rec = {"step": step + 1, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                       "tokens_per_s": tok_per_step / dt, "step_time_s": dt,
                       **self.mfu_meter(tok_per_step / dt),
                       "comm_bytes": comm.STATS.total_bytes() - sum(before.values()),
                       "comm_bytes_by_op": _bytes_by_op(before),
                       "tokens": (step + 1) * tok_per_step, "epoch": self.sampler.epoch(step + 1),
                       "skipped_steps": guard.skipped}
                rec.update(self._router_metrics())
                if hasattr(self.strategy, "last_step_timing"):  # pipeline: measured bubble of this rank
                    rec.update({f"pp_{k}": v for k, v in self.strategy.last_step_timing().items()})
                if hasattr(self.strategy, "offload_timing"):  # ZeRO offload: host copies hidden or waited for
                    rec.update(self.strategy.offload_timing())
                states = self.strategy.model_state_bytes(self.optimizer)
                rec["model_state_bytes"] = states["total_bytes"]
                rec["model_state_breakdown"] = states
                rates.append(rec["tokens_per_s"])
                losses.append(out["loss"])
                if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps or step == 0):
                    rec["val_loss"] = evaluate(self.strategy, self.val_batches, t.dtype, self.device)
                    first_val = rec["val_loss"] if first_val is None else first_val
                    last_val = rec["val_loss"]
                if t.compile:  # Dynamo's counters: flat after the first step (training + evaluation entries)
                    rec.update(compile_stats())
                    if lead and step == self.start_step:
                        print(f"zerotron: compiled the blocks in {rec['compile_time_s']:.1f} s during the first step "
                              f"({rec['graphs']} graphs, {rec['graph_breaks']} graph breaks; Inductor cache "
                              f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", flush=True)
                reached = step + 1
                if writer:  # never raises: a failed append is held (see run_log.MetricsLog)
                    writer.write(rec)
                    guard.io_failed = io_stop and writer.error is not None
                if tb:
                    tb.log(rec)
                if wb:
                    wb.log(rec)
                if callback:
                    callback(self, rec)
                if bar:
                    bar.update(rec)
                guard.check(out["loss"], out["grad_norm"], ckpt.latest_checkpoint(self.run_dir))  # may stop (exit 3)
                if io_stop and step + 1 == t.steps:
                    lifecycle.agree_io(guard)  # the last append: no later step's decide() agrees on it
                ck_every, saved = cfg.checkpoint.every, None
                final = step + 1 == t.steps and cfg.checkpoint.save_final
                if (ck_every and (step + 1) % ck_every == 0) or final:
                    saved = self.save(step + 1, must="final" if final else "")
                    self._log_blocked(writer)
                if guard.stop_io or guard.stop_signal:  # a pending background save completes first
                    this_step = self.saver is not None and self.saver.pending_step == step + 1
                    done = self.finish_pending()
                    saved = done if this_step else saved
                if guard.stop_io:  # metrics.jsonl failed on rank 0, checkpoint.on_error = stop: save, then stop
                    saved = saved or self.save(step + 1, must="metrics")
                    raise self._metrics_stop(step + 1, saved)
                if guard.stop_signal:  # SIGTERM/SIGHUP/SIGINT on some rank, agreed by all: checkpoint, then stop
                    if not saved:
                        saved = self.save(step + 1, must="signal")
                        self._log_blocked(writer)
                    signals.done()
                    raise guard.signal_stop(step + 1, saved)
                if step + 1 == die_at and self.rank == die_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
            self.finish_pending()  # the end of training waits for a background save (may raise RunStopped)
        except lifecycle.RunStopped as e:  # every rank stops here together; rank 0 still writes the summary
            if self.saver is not None and self.saver.pending:  # a background save completes (or fails) first
                self.saver.wait()
            if lead:
                held = writer.held()
                if writer.close() is not None:  # the held records, if the disk has room now; else say so
                    lost, msg = f"; the records of {held} are not in metrics.jsonl (held in memory while it could " \
                        "not be written)", str(e)
                    at = msg.find("; free disk space")
                    e = lifecycle.RunStopped(msg[:at] + lost + msg[at:] if at >= 0 else msg + lost, e.exit_code)
                write_summary(self.run_dir, summary_now(stopped=str(e), exit_code=e.exit_code))
                raise e from None
            raise
        finally:
            for logger in (tb, wb):
                if logger:
                    logger.close()
        signals.uninstall()
        if bar:
            bar.close()
        summary = summary_now()
        if cfg.log.sample_tokens:  # every rank decodes: sharded strategies gather collectively
            summary["sample"] = self.sample(cfg.log.sample_prompt, cfg.log.sample_tokens)
        stop = None
        if self.unsaved is not None:  # the last save failed and none after it (checkpoint.save_final = false)
            newest = ckpt.latest_checkpoint(self.run_dir)
            stop = lifecycle.RunStopped(f"training finished at step {t.steps}, but checkpoint step_{self.unsaved} could "
                                        "not be written and no later save was scheduled (checkpoint.save_final = "
                                        f"false); the newest checkpoint is {newest}; free disk space, then "
                                        + (f"resume with: {lifecycle.resume_command()}" if newest else self._start_again()))
        if lead:
            held = writer.held()
            if (err := writer.close()) is not None and stop is None:
                stop = lifecycle.RunStopped(f"{err}; training finished at step {t.steps} (newest checkpoint "
                                            f"{ckpt.latest_checkpoint(self.run_dir)}), but the records of {held} are "
                                            "not in metrics.jsonl: they were held in memory while the disk was full")
            if cfg.log.plot and err is None:
                try:
                    plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
                except OSError as e:
                    print(f"zerotron: warning: cannot write {self.run_dir / 'loss.png'}: {e.strerror or e}",
                          file=sys.stderr, flush=True)
            if stop is not None:
                summary.update(stopped=str(stop), exit_code=stop.exit_code)
            write_summary(self.run_dir, summary)
        if stop is not None:  # (rank 0 alone may hold unwritten metrics: its exit code says so)
            raise stop
        return summary

    def sample(self, prompt: str, n: int) -> str:
        """Decode ``n`` tokens after ``prompt`` (temperature 0.8, top-k 50, fixed seed)."""
        ids = self.data.tokenizer.encode(prompt).ids or [self.data.eot_id]
        idx = torch.tensor([ids], device=self.device)
        self.model.eval()
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        with self.strategy.full_params() as model:
            out = model.generate(idx, n, temperature=0.8, top_k=50, generator=gen)
        self.model.train()
        return self.data.tokenizer.decode(out[0].tolist())
