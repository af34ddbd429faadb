"""The launch and error prologue shared by the ``zerotron bench`` commands that train (``bench train``,
``bench context``): parse, load the config, check its plan before anything starts, build the token
cache once and relaunch under ``--nproc`` workers; then, in each worker, the process group around
the benchmark body."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from zerotron.config import load_config, parse_overrides
from zerotron.data import prepare_data
from zerotron.distributed.mesh import destroy, init_distributed, teardown
from zerotron.launch import launch, strip_nproc
from zerotron.launch_worker import in_worker
from zerotron.plan import build_plan
from zerotron.train.setup import data_kwargs, load_data

__all__ = ["prologue", "run_body"]


def prologue(command: str, module: str, argv: list[str], parse):
    """Parse and check a bench command line: ``parse(argv) -> (args, rest)`` (argparse's
    ``parse_known_args`` plus the command's own argument checks, raising ValueError) with
    ``args.config`` and ``args.nproc``; ``rest`` are config overrides. The config's plan is built on
    the world size (``--nproc``, or WORLD_SIZE inside a worker) so a refused layout stops here.
    Outside a worker with ``--nproc`` > 1 the token cache is built once and ``module`` is relaunched
    on ``--nproc`` workers. Returns an int exit code (the workers' status after a launch; 2 after
    one ``zerotron <command>: error: ...`` line on stderr for a bad argument, config or data;
    argparse's code for --help or an unknown option), or ``(args, overrides, cfg)`` to run the
    benchmark in this process."""
    try:
        args, rest = parse(argv)
        overrides = parse_overrides(rest)
        cfg = load_config(args.config, overrides)
        build_plan(cfg, int(os.environ["WORLD_SIZE"]) if in_worker() else args.nproc)  # refused before any launch
        if args.nproc > 1 and not in_worker():
            prepare_data(**data_kwargs(cfg))  # build the token cache once, before the workers start
            return launch(args.nproc, strip_nproc(argv), module=module)
    except SystemExit as e:  # argparse: --help or a bad option
        return int(e.code or 0)
    except (ValueError, FileNotFoundError) as e:  # ConfigError, DataError
        print(f"zerotron {command}: error: {e}", file=sys.stderr)
        return 2
    return args, overrides, cfg


def run_body(cfg, body):
    """Run ``body(device, data)`` in this process group (initialised here from ``cfg.parallel``
    unless one exists; torn down afterwards -- destroyed without a barrier after an error, a peer
    may be gone), with the token data loaded (``train.setup.load_data``). Returns ``(rank,
    world_size, device, body's result)``; exceptions propagate."""
    owned = not dist.is_initialized()
    rank, n, dev = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s,
                                    torch.device("cpu") if cfg.train.device == "cpu" else None)
    try:
        out = body(dev, load_data(cfg, int(os.environ.get("LOCAL_RANK", 0))))
    except BaseException:
        if owned:
            destroy()
        raise
    if owned:
        teardown()  # every rank done before any process group goes (no abort at exit)
    return rank, n, dev, out
