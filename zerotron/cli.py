"""Command line: ``zerotron train | generate | serve | export | memory | plan | schedule | bench``.

Every user error (config, file, checkpoint, shape) ends in one line ``zerotron: error: ...`` on
stderr and exit code 2; nothing already on disk is modified by a run that fails validation.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .cli_help import HelpFormatter
from .launch import strip_nproc as _strip_nproc

USAGE = """usage: zerotron <command> [options]

commands:
  train      train a GPT-2 or Llama (zerotron train --config configs/default.toml --nproc 2)
  generate   sample text from a checkpoint (zerotron generate --checkpoint runs/X --prompt "ROMEO:")
  serve      OpenAI-compatible HTTP server (zerotron serve --checkpoint runs/X --port 8000 --nproc 2)
  export     checkpoint (any layout) -> Hugging Face GPT-2/Llama safetensors (zerotron export --checkpoint runs/X --out hf/)
  memory     ZeRO model-state memory per rank (zerotron memory --model gpt2 --dp 8)
  plan       rank parallel layouts for a cluster (zerotron plan --model gpt2 --gpus 8 --gpus-per-node 8 --gpu-mem 80GB --global-batch 256 --seq 1024)
  schedule   draw a pipeline schedule (zerotron schedule --pp 4 --microbatches 8 --kind 1f1b)
  bench      benchmarks: 'bench comm' (collectives), 'bench train' (layouts side by side),
             'bench plan' (the planner's predicted ranking vs a 'bench train' run) and
             'bench generate' (inference layouts side by side), 'bench serve' (continuous vs
             window batching) and 'bench checkpoint'
             (the cost of checkpoint checksums)

Run 'zerotron <command> --help' for the options of one command; 'zerotron --version' for the version.
"""

BENCH_USAGE = """usage: zerotron bench comm|train|plan|generate|serve|checkpoint [options]

  comm    collective bandwidth (nccl-tests algbw/busbw) per op and message size
  train   training throughput of parallel layouts side by side (zerotron bench train --layouts dp,single)
  plan    the planner's predicted ranking vs a 'bench train' run (Spearman correlation)
  generate  batched generation throughput of inference layouts (zerotron bench generate --nproc 2)
  serve   continuous vs window batching of zerotron serve under staggered arrivals (zerotron bench serve)
  checkpoint  what checkpoint checksums cost: save / hash / verify / load seconds (zerotron bench checkpoint)

Run 'zerotron bench <comm|train|plan|generate|serve|checkpoint> --help' for the options of one benchmark.
"""


def version() -> str:
    """The installed package version (``importlib.metadata``), else ``zerotron.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _v

    try:
        return _v("zerotron")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def _fail(msg: str) -> int:
    print(f"zerotron: error: {msg}", file=sys.stderr)
    return 2


def _collective_error():
    from .distributed.comm import CollectiveError

    return CollectiveError


def _user_errors():
    from .config import ConfigError
    from .data import DataError
    from .train.checkpoint import CheckpointError

    return (ConfigError, DataError, CheckpointError, FileNotFoundError, FileExistsError)


def train_parser() -> argparse.ArgumentParser:
    from .config_doc import fields_help

    p = argparse.ArgumentParser(prog="zerotron train", formatter_class=HelpFormatter, epilog=fields_help(),
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
    from .config import ConfigError, load_config, parse_overrides
    from .launch import in_worker, launch
    from .plan import build_plan

    args, rest = train_parser().parse_known_args(argv)
    from .train.lifecycle import RunStopped

    lock = None
    try:
        cfg = load_config(args.config, parse_overrides(rest))
        if args.nproc < 0:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        if args.max_restarts and args.nproc < 1 and not in_worker():
            raise ConfigError("--max-restarts restarts the worker processes of --nproc N: add --nproc (under "
                              "torchrun, pass torchrun --max-restarts instead)")
        world = int(os.environ["WORLD_SIZE"]) if in_worker() else max(1, args.nproc)
        build_plan(cfg, world)
        from .train.tensorboard import tensorboard_enabled

        tensorboard_enabled(cfg.log.tensorboard)  # "true" without the package: one line, before any worker
        from .train.wandb_log import wandb_enabled

        wandb_enabled(cfg.log.wandb)  # likewise log.wandb = true without the wandb package
        if args.resume and not args.run_dir:
            raise ConfigError("--resume needs --run-dir (the run to continue)")
        run_dir = Path(args.run_dir or f"runs/{Path(args.config or 'default').stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        from .train.lifecycle import restart_count

        restart = restart_count() if in_worker() else 0  # > 0: torch elastic restarted the workers
        if not in_worker() or (os.environ.get("RANK") == "0" and "ZEROTRON_LOCK_HELD" not in os.environ):
            # the launcher, a single process, or rank 0 under torchrun (again in each restart: the
            # failed attempt's lock went with its process)
            lock = _lock_run_dir(run_dir, quiet=restart > 0)
        from .train.checkpoint import list_checkpoints

        resume = args.resume or (restart > 0 and bool(list_checkpoints(run_dir)))  # a restart resumes
        if not in_worker():
            import shlex

            os.environ["ZEROTRON_RESUME_CMD"] = shlex.join(
                ["zerotron", "train", *argv, *([] if args.run_dir else ["--run-dir", str(run_dir)]),
                 *([] if args.resume else ["--resume"])])
        from .train.trainer import check_run_dir

        if not restart:  # a restart continues (or, before any checkpoint, replaces) its own run
            check_run_dir(run_dir, resume)
        elif not resume and os.environ.get("RANK") == "0" and "ZEROTRON_LOCK_HELD" not in os.environ:
            print(f"zerotron: restart {restart}: no checkpoint yet, starting again from step 0", file=sys.stderr)
        if args.resume and not in_worker():
            from .train.trainer import check_resume

            check_resume(cfg, run_dir)  # shape mismatch: one message before any worker starts
        if (args.nproc > 1 or args.max_restarts) and not in_worker():
            from .data import prepare_data  # build the token cache once, report data errors once

            d = cfg.data
            prepare_data(d.corpus, d.path or None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir,
                         d.tokenizer or None)
            worker_argv = ["train", *_strip_nproc(argv, ("--nproc", "--max-restarts"))]
            if not args.run_dir:
                worker_argv += ["--run-dir", str(run_dir)]
            print(f"zerotron: launching {args.nproc} workers, run directory {run_dir}", file=sys.stderr)
            os.environ["ZEROTRON_LOCK_HELD"] = str(os.getpid())  # the workers do not lock again
            code = launch(args.nproc, worker_argv, shutdown_timeout_s=cfg.train.stop_grace_s + 5,
                          max_restarts=args.max_restarts, on_restart=_announce_restart(run_dir))
            lock.release()
            return code
        import torch.distributed as dist

        from .distributed import mesh
        from .train.trainer import Trainer

        owned = not dist.is_initialized()  # this run creates the process group (a worker, or alone)
        trainer = Trainer(cfg, run_dir, resume=resume, restart=restart)
        summary = trainer.fit()
        if owned:
            mesh.teardown()  # every rank done before any process group goes (no abort at exit)
        if trainer.rank == 0 and not summary.get("nothing_to_do"):
            _print_summary(summary, run_dir)
        if lock:
            lock.release()
        return 0
    except RunStopped as e:  # every rank stopped at the same step (guard or signal)
        import signal

        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # the launcher may forward the signal while we exit
        if os.environ.get("RANK", "0") == "0":
            print(f"zerotron: {e}", file=sys.stderr, flush=True)
        import torch.distributed as dist

        if dist.is_initialized():
            from .distributed import mesh

            mesh.teardown()
        if lock:
            lock.release()
        return e.exit_code
    except _collective_error() as e:  # a dead or hung peer: one line naming the collective and the peers
        print(f"zerotron: {e}", file=sys.stderr, flush=True)
        if lock:
            lock.release()
        return 1
    except _user_errors() as e:
        if lock:
            lock.release(failed_validation=True)
        return _fail(str(e))


def _lock_run_dir(run_dir: Path, quiet: bool = False):
    """Take the run-directory lock (``train.lifecycle.RunLock``) and remove ``.tmp_step_*``
    directories a killed save left behind, saying so (``quiet``: not, in a restart under torchrun,
    where taking over the failed attempt's lock and removing its partial save are expected);
    returns the lock. Raises ConfigError when another run holds the directory."""
    from .train.checkpoint import remove_stale_tmp
    from .train.lifecycle import RunLock

    lock = RunLock(run_dir)
    msg = lock.acquire()
    if msg and not quiet:
        print(msg, file=sys.stderr)
    for p in remove_stale_tmp(run_dir):
        if not quiet:
            print(f"zerotron: removed {p} (an incomplete checkpoint of a save that did not finish)", file=sys.stderr)
    return lock


def _announce_restart(run_dir: Path):
    """The launcher's ``on_restart`` for ``--max-restarts``: one line naming the worker that failed
    and the step the new workers resume from (``train.lifecycle.prepare_restart``)."""
    def announce(failure: str, count: int, limit: int) -> None:
        from .train.lifecycle import prepare_restart

        try:
            where = prepare_restart(run_dir)
        except Exception as e:  # noqa: BLE001 - the agent restarts the workers anyway; they report it
            where = f"could not inspect {run_dir} ({type(e).__name__}: {e})"
        print(f"zerotron: {failure}; restart {count} of {limit}: {where}", file=sys.stderr, flush=True)
    return announce


def _print_summary(s: dict, run_dir: Path) -> None:
    def f(v):
        return "n/a" if v is None else f"{v:.4f}"

    print(f"\nrun directory: {run_dir}")
    print(f"steps {s['steps']}  final train loss {f(s['final_loss'])}  validation loss "
          f"{f(s['first_val_loss'])} -> {f(s['final_val_loss'])}  median tokens/s "
          f"{s['median_tokens_per_s'] or 0:.0f}")
    if s.get("sample"):
        print("sample:\n" + s["sample"])


def generate_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron generate``."""
    p = argparse.ArgumentParser(prog="zerotron generate", formatter_class=HelpFormatter,
                                description="Generate text from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompts-file", help="one prompt per line; spread over data-parallel ranks with --nproc")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate after each prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (deterministic)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the most likely tokens of mass p")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i: seed + i)")
    p.add_argument("--nproc", type=int, default=0,
                   help="N local processes (data parallel over prompts, x tp x pp; 0 = this process alone)")
    p.add_argument("--parallel.tp", dest="tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--parallel.pp", dest="pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches in flight (0 = pp)")
    return p


def cmd_generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    from .generate import generate_main
    from .launch import in_worker, launch

    try:
        if args.nproc > 1 and not in_worker():
            from .data import load_tokenizer
            from .generate import check_sampling_args, read_prompts, resolve_checkpoint
            from .train.checkpoint import read_meta

            check_sampling_args(args)
            ckpt_dir = resolve_checkpoint(args.checkpoint)
            model_cfg = read_meta(ckpt_dir).get("model_config", {})
            n_head = model_cfg.get("n_head", 1)
            n_kv_head = model_cfg.get("n_kv_head", n_head)
            read_prompts(args, load_tokenizer(ckpt_dir / "tokenizer.json"))  # fail once, before the workers
            if args.tp < 1 or args.pp < 1 or args.nproc % (args.tp * args.pp):
                raise ValueError(f"--nproc {args.nproc} must be a multiple of --parallel.tp x --parallel.pp "
                                 f"({args.tp} x {args.pp})")
            if n_head % args.tp or n_kv_head % args.tp:
                raise ValueError(f"--parallel.tp {args.tp} must divide the model's n_head ({n_head}) and "
                                 f"n_kv_head ({n_kv_head})")
            return launch(args.nproc, ["generate", *_strip_nproc(argv)])
        return generate_main(args)
    except _user_errors() as e:
        return _fail(str(e))
    except ValueError as e:
        return _fail(str(e))


def export_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron export``."""
    p = argparse.ArgumentParser(prog="zerotron export", formatter_class=HelpFormatter, description="Export a "
                                "checkpoint of any layout as a Hugging Face directory (config.json + "
                                "model.safetensors): GPT2LMHeadModel or LlamaForCausalLM, by the model's family.")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    return p


def cmd_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    try:
        import torch

        from .data.tokenizer import EOT
        from .distributed import mesh
        from .generate import load_model
        from .models.registry import export_hf

        owned = not torch.distributed.is_initialized()
        mesh.init_distributed(timeout_s=600, device=torch.device("cpu"))
        model, tok, _ = load_model(args.checkpoint, torch.device("cpu"))
        # the checkpoint's tokenizer.json (load_tokenizer checked it defines <|endoftext|>)
        out = export_hf(model, args.out, overwrite=args.overwrite, eos_token_id=tok.token_to_id(EOT))
        tok.save(str(Path(out) / "tokenizer.json"))
        if owned:
            mesh.teardown()
        print(f"wrote {out}")
        return 0
    except _user_errors() as e:
        return _fail(str(e))
    except ValueError as e:
        return _fail(str(e))


def cmd_bench(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help", "help"):
        print(BENCH_USAGE)
        return 0
    if argv and argv[0] == "generate":
        from .bench.generate import main as generate_bench_main

        return generate_bench_main(argv[1:])
    if argv and argv[0] == "serve":
        from .bench.serve import main as serve_bench_main

        return serve_bench_main(argv[1:])
    if argv and argv[0] == "checkpoint":
        from .bench.checkpoint import main as checkpoint_bench_main

        return checkpoint_bench_main(argv[1:])
    if not argv or argv[0] not in ("comm", "train", "plan"):
        return _fail("usage: zerotron bench comm|train|plan|generate|serve|checkpoint [options] (see 'zerotron bench comm --help'); "
                     "'bench plan' checks the planner's ranking against a 'bench train' run")
    if argv[0] == "comm":
        from .bench.comm import main as comm_main

        return comm_main(argv[1:])
    if argv[0] == "plan":
        from .bench.validate_plan import main as validate_main

        return validate_main(argv[1:])
    from .bench.train import main as train_bench_main

    return train_bench_main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zerotron`` command; returns the exit code (0 ok, 2 user error, 130 after
    Ctrl-C: one line from the launcher or the single process, nothing from the workers)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C / the agent's SIGINT: no new traceback
        from .launch import in_worker

        if in_worker():  # the launcher reports once for all workers; skip teardown (peers are going too)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        print("zerotron: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zerotron plan ... | head`: the reader left; stop quietly, like a Unix tool
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 0


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"zerotron {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return cmd_train(rest)
    if cmd == "generate":
        return cmd_generate(rest)
    if cmd == "memory":
        from .analysis.memory import memory_main

        return memory_main(rest)
    if cmd == "schedule":
        from .analysis.schedule_plot import schedule_main

        return schedule_main(rest)
    if cmd == "bench":
        return cmd_bench(rest)
    if cmd == "export":
        return cmd_export(rest)
    if cmd == "serve":
        from .serve import main as serve_main

        return serve_main(rest)
    if cmd == "plan":
        from .analysis.plan_cli import plan_main

        return plan_main(rest)
    return _fail(f"unknown command {cmd!r}; commands: train, generate, serve, export, memory, plan, schedule, bench")


if __name__ == "__main__":
    sys.exit(main())
