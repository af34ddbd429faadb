"""``zerotron train``: argument parsing, the run-directory lock, launching ``--nproc`` workers
(with ``--max-restarts``) or training in this process, and the summary."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..cli_help import HelpFormatter, OneLineErrorParser
from ..launch import strip_nproc
from .errors import collective_error, fail, out_of_memory, user_errors


def train_parser() -> argparse.ArgumentParser:
    from ..config_doc import fields_help

    p = OneLineErrorParser(prog="zerotron train", formatter_class=HelpFormatter, epilog=fields_help(),
                                description="Train a GPT-2 or Llama model. Any config field (listed below) can be overridden as "
                                "--section.field VALUE (e.g. --train.steps 50).")
    p.add_argument("--config", help="TOML config file (see configs/)")
    p.add_argument("--nproc", type=int, default=0, help="start N local worker processes (torch elastic launcher; 0 = this process alone)")
    p.add_argument("--run-dir", help="output directory (default runs/<config>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument("--max-restarts", type=int, default=0, help="after a worker of --nproc dies, restart all "
                   "workers up to N times, from the newest good checkpoint (torch elastic; 0 = never)")
    return p


def cmd_train(argv: list[str]) -> int:
    from ..config import ConfigError, load_config, parse_overrides
    from ..launch import launch
    from ..launch_worker import in_worker
    from ..plan import build_plan

    args, rest = train_parser().parse_known_args(argv)
    from ..train.stop import RunStopped, StartupStopped, install_startup_stop, restore_handlers

    lock = None
    owned = True  # whether this call creates the process group (then it also destroys it)
    handlers: dict = {}
    try:
        # a signal before the step loop (whose GracefulStop then takes over): RunStopped below, one line
        handlers = install_startup_stop()
        cfg = load_config(args.config, parse_overrides(rest))
        if args.nproc < 0:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        if args.max_restarts and args.nproc < 1 and not in_worker():
            raise ConfigError("--max-restarts restarts the worker processes of --nproc N: add --nproc (under "
                              "torchrun, pass torchrun --max-restarts instead)")
        world = int(os.environ["WORLD_SIZE"]) if in_worker() else max(1, args.nproc)
        plan = build_plan(cfg, world)  # every layout rule, before anything is written; the Trainer takes it
        from ..analysis.memory import offload_dir_refusal

        refusal = offload_dir_refusal(cfg, plan)  # the disk tier's folder: exists, writable, large enough
        if refusal:
            raise ConfigError(refusal)
        from ..train.tensorboard import tensorboard_enabled

        tensorboard_enabled(cfg.log.tensorboard)  # "true" without the package: one line, before any worker
        from ..train.wandb_log import wandb_enabled

        wandb_enabled(cfg.log.wandb)  # likewise log.wandb = true without the wandb package
        if args.resume and not args.run_dir:
            raise ConfigError("--resume needs --run-dir (the run to continue)")
        run_dir = Path(args.run_dir or f"runs/{Path(args.config or 'default').stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        from ..train.restarts import restart_count

        restart = restart_count() if in_worker() else 0  # > 0: torch elastic restarted the workers
        if not in_worker() or (os.environ.get("RANK") == "0" and "ZEROTRON_LOCK_HELD" not in os.environ):
            # the launcher, a single process, or rank 0 under torchrun (again in each restart: the
            # failed attempt's lock went with its process)
            lock = lock_run_dir(run_dir, quiet=restart > 0)
        from ..train.checkpoint import list_checkpoints

        resume = args.resume or (restart > 0 and bool(list_checkpoints(run_dir)))  # a restart resumes
        if not in_worker():
            import shlex

            os.environ["ZEROTRON_RESUME_CMD"] = shlex.join(
                ["zerotron", "train", *argv, *([] if args.run_dir else ["--run-dir", str(run_dir)]),
                 *([] if args.resume else ["--resume"])])
        from ..train.setup import check_run_dir

        if not restart:  # a restart continues (or, before any checkpoint, replaces) its own run
            check_run_dir(run_dir, resume)
        elif not resume and os.environ.get("RANK") == "0" and "ZEROTRON_LOCK_HELD" not in os.environ:
            print(f"zerotron: restart {restart}: no checkpoint yet, starting again from step 0", file=sys.stderr)
        latest = None
        if resume:  # the one resume check of this process (the Trainer takes its verdict): the newest
            # good checkpoint; only the launcher or a single process renames damaged ones, and workers
            # started after it skip re-hashing what it verified (ZEROTRON_CKPT_VERIFIED)
            from ..train.setup import check_resume

            latest = check_resume(cfg, run_dir, quarantine=not in_worker(), tokenizer_note=not in_worker())  # one line each
            if args.resume and not restart:
                refuse_finished_resume(cfg, latest)  # before any worker starts
        if (args.nproc > 1 or args.max_restarts) and not in_worker():
            from ..data import prepare_data  # build the token cache once, report data errors once
            from ..train.setup import data_kwargs

            data = prepare_data(**data_kwargs(cfg))
            if cfg.model.init_from:  # the checkpoint's config was read by build_plan: its vocabulary too
                from ..models.registry import hf_config
                from ..train.setup import check_init_vocab

                check_init_vocab(hf_config(cfg.model.init_from).vocab_size, data.vocab_size)
            worker_argv = ["train", *strip_nproc(argv, ("--nproc", "--max-restarts"))]
            if not args.run_dir:
                worker_argv += ["--run-dir", str(run_dir)]
            print(f"zerotron: launching {args.nproc} workers, run directory {run_dir}", file=sys.stderr)
            os.environ["ZEROTRON_LOCK_HELD"] = str(os.getpid())  # the workers do not lock again
            from ..train.stop import STARTUP_STOP

            code = launch(args.nproc, worker_argv, shutdown_timeout_s=cfg.train.stop_grace_s + 5,
                          max_restarts=args.max_restarts, on_restart=announce_restart(run_dir),
                          startup_stop=STARTUP_STOP.replace("stopped;", f"the {args.nproc} workers were stopped;"))
            lock.release()
            return code
        import torch.distributed as dist

        from ..distributed import mesh
        from ..train.trainer import Trainer

        owned = not dist.is_initialized()  # this run creates the process group (a worker, or alone)
        trainer = Trainer(cfg, run_dir, resume=resume, restart=restart, plan=plan, resume_from=latest)
        summary = trainer.fit()
        if owned:
            mesh.teardown()  # every rank done before any process group goes (no abort at exit)
        if trainer.rank == 0 and not summary.get("nothing_to_do"):
            print_summary(summary, run_dir)
        if lock:
            lock.release()
        return 0
    except RunStopped as e:  # every rank stopped at the same step (guard or signal), or before the first step
        import signal

        handlers = {}  # not restored: ignored while this process exits
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # the launcher may forward the signal while we exit
        if os.environ.get("RANK", "0") == "0":
            print(f"zerotron: {e}", file=sys.stderr, flush=True)
        dist = sys.modules.get("torch.distributed")  # not imported again: a signal may have cut its import short
        # not a caller's group (a library or test process keeps its own)
        if owned and dist is not None and dist.is_initialized():
            from ..distributed import mesh

            # before the first step the ranks stop where each one is: no barrier (a peer may be elsewhere)
            mesh.destroy() if isinstance(e, StartupStopped) else mesh.teardown()
        if lock:
            lock.release()
        return e.exit_code
    except collective_error() as e:  # a dead or hung peer: one line naming the collective and the peers
        print(f"zerotron: {e}", file=sys.stderr, flush=True)
        if lock:
            lock.release()
        return 1
    except user_errors() as e:
        if lock:
            lock.release(failed_validation=True)
        return fail(str(e))
    except (RuntimeError, MemoryError) as e:  # a model or batch too large for memory: one line, not a traceback
        msg = out_of_memory(e)
        if msg is None:
            raise
        if lock:
            lock.release(failed_validation=True)  # a run directory it made that holds nothing is removed
        return fail(msg)
    finally:
        restore_handlers(handlers)  # a library caller's (or pytest's) own handlers


def refuse_finished_resume(cfg, latest: Path) -> None:
    """``--resume`` of a run whose checkpoint ``latest`` already reached ``train.steps`` (or more):
    raise ConfigError naming the step reached and the fix (raise train.steps above it), before
    anything is trained or written."""
    from ..config import ConfigError
    from ..train.checkpoint import read_meta

    reached = int(read_meta(latest).get("step", 0))
    if cfg.train.steps <= reached:
        raise ConfigError(f"--resume: nothing to train: the run already reached step {reached} ({latest}) and "
                          f"train.steps = {cfg.train.steps}; raise train.steps above {reached} to continue it "
                          f"(e.g. --train.steps {2 * reached})")


def lock_run_dir(run_dir: Path, quiet: bool = False):
    """Take the run-directory lock (``train.run_lock.RunLock``) and remove ``.tmp_step_*``
    directories a killed save left behind, saying so (``quiet``: not, in a restart under torchrun,
    where taking over the failed attempt's lock and removing its partial save are expected);
    returns the lock. Raises ConfigError when another run holds the directory."""
    from ..train.checkpoint.files import remove_stale_tmp
    from ..train.run_lock import RunLock

    lock = RunLock(run_dir)
    msg = lock.acquire()
    if msg and not quiet:
        print(msg, file=sys.stderr)
    try:
        stale = remove_stale_tmp(run_dir)  # CheckpointError: <run_dir>/checkpoints is not a folder
    except BaseException:
        lock.release(failed_validation=True)  # (a run directory it made is removed)
        raise
    for p in stale:
        if not quiet:
            print(f"zerotron: removed {p} (an incomplete checkpoint of a save that did not finish)", file=sys.stderr)
    return lock


def announce_restart(run_dir: Path):
    """The launcher's ``on_restart`` for ``--max-restarts``: one line naming the worker that failed
    and the step the new workers resume from (``train.restarts.prepare_restart``)."""
    def announce(failure: str, count: int, limit: int) -> None:
        from ..train.restarts import prepare_restart

        try:
            where = prepare_restart(run_dir)
        except Exception as e:  # noqa: BLE001 - the agent restarts the workers anyway; they report it
            where = f"could not inspect {run_dir} ({type(e).__name__}: {e})"
        print(f"zerotron: {failure}; restart {count} of {limit}: {where}", file=sys.stderr, flush=True)
    return announce


def print_summary(s: dict, run_dir: Path) -> None:
    def f(v):
        return "n/a" if v is None else f"{v:.4f}"

    print(f"\nrun directory: {run_dir}")
    print(f"steps {s['steps']}  final train loss {f(s['final_loss'])}  validation loss "
          f"{f(s['first_val_loss'])} -> {f(s['final_val_loss'])}  median tokens/s "
          f"{s['median_tokens_per_s'] or 0:.0f}")
    if s.get("sample"):
        print("sample:\n" + s["sample"])
