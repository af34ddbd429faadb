"""The step loop of a training run (:meth:`RunLoop.fit`): each optimizer step, its metrics record
(loss, throughput, MFU, bytes moved per collective, MoE router statistics, memory), evaluation,
checkpoints on schedule and on a stop, the loggers, and the end-of-run summary and plot."""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

import torch

from ..distributed import comm
from ..models.moe import take_router_stats, update_expert_bias
from ..parallel.compile import compile_stats
from . import checkpoint as ckpt
from . import lifecycle
from .metrics import MetricsWriter, plot_losses, read_metrics
from .progress import Progress
from .run_log import MetricsLog, write_summary
from .step import evaluate, train_step
from .stop import loop_ended
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


class RunLoop:
    """The step loop of :class:`~zerotron.train.trainer.Trainer` (a mixin: it uses the attributes
    ``Trainer.__init__`` sets and the saves of :class:`~zerotron.train.run_saves.RunSaves`)."""

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
        lifecycle.fault_gate(self.start_step, self.rank)  # tests: a gate before the first step (start-up)
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
                lifecycle.fault_gate(step + 1, self.rank)  # tests: a gate after this step (ZEROTRON_FAULT_GATE)
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
        loop_ended(t.steps)  # a signal during the sample: "after the last training step", not "before the first"
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
