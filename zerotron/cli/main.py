"""The ``zerotron`` command: usage, version and dispatch to one module per command."""
from __future__ import annotations

import difflib
import importlib
import os
import shlex
import sys

from .errors import fail

# command -> (module, entry point taking the remaining argv and returning an exit code)
COMMANDS = {
    "train": ("zerotron.cli.train", "cmd_train"),
    "generate": ("zerotron.cli.generate", "cmd_generate"),
    "serve": ("zerotron.serve", "main"),
    "export": ("zerotron.cli.export", "cmd_export"),
    "memory": ("zerotron.analysis.memory_cli", "memory_main"),
    "plan": ("zerotron.analysis.plan_cli", "plan_main"),
    "dryrun": ("zerotron.analysis.dryrun_cli", "dryrun_main"),
    "schedule": ("zerotron.analysis.schedule_plot", "schedule_main"),
    "bench": ("zerotron.cli.bench", "cmd_bench"),
}

USAGE = """usage: zerotron <command> [options]

commands:
  train      train a GPT-2 or Llama (zerotron train --config configs/default.toml --nproc 2)
  generate   sample text from a checkpoint (zerotron generate --checkpoint runs/X --prompt "ROMEO:")
  serve      OpenAI-compatible HTTP server (zerotron serve --checkpoint runs/X --port 8000 --nproc 2)
  export     checkpoint (any layout) -> Hugging Face GPT-2/Llama safetensors (zerotron export --checkpoint runs/X --out hf/)
  memory     ZeRO model-state memory per rank (zerotron memory --model gpt2 --dp 8)
  plan       rank parallel layouts for a cluster (zerotron plan --model gpt2 --gpus 8 --gpus-per-node 8 --gpu-mem 80GB --global-batch 256 --seq 1024)
  dryrun     trace one step of chosen ranks of a big layout in this process (fake tensors and process group):
             peak memory and collective bytes vs the estimators (zerotron dryrun --config configs/dryrun_llama3_8b.toml --world 1024)
  schedule   draw a pipeline schedule (zerotron schedule --pp 4 --microbatches 8 --kind 1f1b)
  bench      benchmarks: 'bench comm' (collectives), 'bench train' (layouts side by side),
             'bench plan' (the planner's predicted ranking vs a 'bench train' run) and
             'bench generate' (inference layouts side by side), 'bench serve' (continuous vs
             window batching) and 'bench checkpoint'
             (the cost of checkpoint checksums)

Run 'zerotron <command> --help' for the options of one command; 'zerotron --version' for the version.
"""

def version() -> str:
    """The installed package version (``importlib.metadata``), else ``zerotron.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _v

    try:
        return _v("zerotron")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zerotron`` command; returns the exit code (0 ok, 2 user error, 130 after
    Ctrl-C: one line from the launcher or the single process, nothing from the workers)."""
    if argv is None:  # the program itself (console script, python -m, a torchrun worker), not a library caller
        from ..host_heap import retain

        try:
            retain()  # glibc's heap thresholds fixed: no page faults per step (zerotron.host_heap)
        except ValueError as e:
            return fail(str(e))
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(argv)
        if program and getattr(sys.modules.get("zerotron.launch"), "launched", False):
            # a launcher whose workers have ended: its interpreter's last collections would scan every
            # object of torch and of the stack it preloaded for forked workers (~0.8 CPU s; 10-14 s of
            # wall at a load average of ~20, which held up `serve --nproc`'s exit after a SIGTERM)
            import gc

            gc.freeze()
        return code
    except KeyboardInterrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C / the agent's SIGINT: no new traceback
        from ..launch_worker import in_worker

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
    if len(argv) == 2 and argv[0] in ("-h", "--help", "help") and argv[1] in COMMANDS:
        argv = [argv[1], "--help"]  # `zerotron help train`: that command's own help
    if argv and argv[0] in ("-h", "--help", "help", "-V", "--version") and len(argv) > 1:
        # `zerotron --version extra` printed the version and ignored the rest (a typo went unseen)
        what = "prints the version" if argv[0] in ("-V", "--version") else "prints the usage"
        return fail(f"{argv[0]} {what} and takes no arguments, got {shlex.join(argv[1:])!r}; run "
                    f"'zerotron {argv[0]}' alone, or 'zerotron <command> --help' for the options of a command")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"zerotron {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in COMMANDS:
        module, name = COMMANDS[cmd]  # imported on demand: --help and usage errors stay fast
        return getattr(importlib.import_module(module), name)(rest)
    near = difflib.get_close_matches(cmd, list(COMMANDS), n=1)
    return fail(f"unknown command {cmd!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                + f"; commands: {', '.join(COMMANDS)}")
