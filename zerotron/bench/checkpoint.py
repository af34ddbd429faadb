"""``zerotron bench checkpoint``: what the integrity checks of a checkpoint cost.

One process builds the run's model, optimizer and scheduler exactly as ``zerotron train`` does
(:class:`~zerotron.train.trainer.Trainer`), then, ``--rounds`` times, writes a checkpoint
(``save_checkpoint``: DCP files, RNG, trainer state, ``meta.json`` with a SHA-256 per file),
re-hashes the written files (the checksum share of the save), verifies the checkpoint with and
without checksums (what ``--resume``, ``generate`` and ``export`` run before loading) and loads it.
Reports medians in seconds and the checksum overhead as a percentage of the save and of the
verify-and-load time. The files are written to a temporary directory under ``--dir`` (default: the
system's), which is removed afterwards.

``--blocking`` measures instead the training time each save blocks, synchronous against
asynchronous (``checkpoint.async_save``), on ``--nproc`` ranks: per round a synchronous save
(blocked for the whole write), then an asynchronous one (blocked while staging the state into host
memory; the background write that follows is timed too, waited for before the next round, so the
figure assumes the checkpoint interval is longer than the write).
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..out_files import out_file_refusal, write_out_file

USAGE = ("zerotron bench checkpoint [--config FILE] [--rounds N] [--dir DIR] [--blocking] [--nproc N] [--json F] "
         "[--markdown F] [--section.field V ...]")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(cfg, rounds: int, where: str | None) -> dict:
    """Median seconds over ``rounds`` of: ``save_s`` (the whole collective save, checksums
    included), ``checksum_s`` (SHA-256 of every file of the checkpoint, the part of the save that
    exists for integrity), ``verify_s`` (file sizes from DCP's metadata, no hashing) and
    ``verify_checksums_s`` (sizes + hashes), ``load_s`` (DCP load into model and optimizer).
    Also ``bytes`` (on disk), ``params`` and the overheads in percent. Runs in this process
    (world size 1); raises whatever the trainer raises for a bad config (ConfigError)."""
    from zerotron.train import checkpoint as ckpt
    from zerotron.train.checkpoint.files import dir_bytes
    from zerotron.train.checkpoint.integrity import checksums
    from zerotron.train.checkpoint.load import init_optimizer_state
    from zerotron.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="zerotron_bench_ckpt_", dir=where))
    try:
        trainer = Trainer(cfg, tmp / "run")
        init_optimizer_state(trainer.optimizer)  # the Adam moments a real checkpoint holds
        rows = []
        for r in range(rounds):
            step = r + 1
            save = _timed(lambda s=step: trainer.save(s))
            path = ckpt.latest_checkpoint(tmp / "run")
            rows.append({"save_s": save,
                         "checksum_s": _timed(lambda p=path: checksums(p)),
                         "verify_s": _timed(lambda p=path: ckpt.verify_checkpoint(p, verify_checksums=False)),
                         "verify_checksums_s": _timed(lambda p=path: ckpt.verify_checkpoint(p)),
                         "load_s": _timed(lambda p=path: ckpt.load_checkpoint(p, trainer.strategy, trainer.optimizer,
                                                                             trainer.scheduler)),
                         "bytes": dir_bytes(path)})
            shutil.rmtree(path)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        hash_on_resume = med["verify_checksums_s"] - med["verify_s"]
        return {**med, "params": trainer.num_params, "rounds": rounds,
                "checksum_pct_of_save": 100 * med["checksum_s"] / med["save_s"],
                "checksum_pct_of_resume": 100 * hash_on_resume / (med["verify_checksums_s"] + med["load_s"]),
                "hash_rate_gb_s": med["bytes"] / med["checksum_s"] / 1e9, "rows": rows}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _blocking_rank(cfg, rounds: int, tmp: str) -> list[dict]:
    """One rank of :func:`measure_blocking` (all ranks call it; results of this rank)."""
    from zerotron.train.checkpoint.background import AsyncSaver
    from zerotron.train.checkpoint.files import dir_bytes
    from zerotron.train.checkpoint.load import init_optimizer_state
    from zerotron.train.trainer import Trainer

    trainer = Trainer(cfg, Path(tmp) / "run")
    init_optimizer_state(trainer.optimizer)
    rows, saver = [], AsyncSaver(trainer.strategy)  # collective: its process groups
    for r in range(rounds):
        trainer.saver = None
        path = trainer.save(2 * r + 1)
        sync = trainer.ckpt_blocked_s
        size = dir_bytes(path)
        trainer.saver = saver
        trainer.save(2 * r + 2)
        blocked = trainer.ckpt_blocked_s
        t = time.perf_counter()
        trainer.finish_pending()
        rows.append({"sync_blocked_s": sync, "async_blocked_s": blocked,
                     "async_write_s": time.perf_counter() - t, "bytes": size})
    return rows


def measure_blocking(cfg, rounds: int, where: str | None, nproc: int) -> dict:
    """Median over ``rounds`` (and the max over ranks) of ``sync_blocked_s`` (a synchronous save,
    whole), ``async_blocked_s`` (an asynchronous save: staging only) and ``async_write_s`` (the
    rest of the background write, waited for afterwards); ``ratio`` = async ÷ sync blocked time.
    ``nproc`` > 1 spawns that many gloo ranks on this machine. Raises ConfigError for a bad config."""
    from zerotron.testing import run_ranks

    tmp = Path(tempfile.mkdtemp(prefix="zerotron_bench_ckpt_", dir=where))
    try:
        if nproc == 1:
            from zerotron.distributed.mesh import init_distributed

            init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
            per_rank = [_blocking_rank(cfg, rounds, str(tmp))]
        else:
            per_rank = run_ranks(_blocking_rank, nproc, cfg, rounds, str(tmp), timeout_s=1800.0, fresh=True)
        rows = [{k: max(pr[i][k] for pr in per_rank) for k in per_rank[0][i]} for i in range(rounds)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        return {**med, "ratio": med["async_blocked_s"] / med["sync_blocked_s"], "nproc": nproc, "rounds": rounds,
                "rows": rows}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def markdown_blocking(res: dict, label: str) -> str:
    """One-row table of :func:`measure_blocking`'s result."""
    return ("| model | ranks | checkpoint | sync save, blocked (s) | async save, blocked (s) | async ÷ sync | "
            "background write (s) |\n|---|---|---|---|---|---|---|\n"
            f"| {label} | {res['nproc']} | {res['bytes'] / 2**20:.1f} MiB | {res['sync_blocked_s']:.3f} | "
            f"{res['async_blocked_s']:.3f} | {res['ratio']:.3f} | {res['async_write_s']:.3f} |\n")


def markdown(res: dict, label: str) -> str:
    """One-row table of :func:`measure`'s result."""
    return ("| model | params | checkpoint | save (s) | checksums (s) | % of save | verify, sizes only (s) | "
            "verify + checksums (s) | load (s) | % of resume | hash rate |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
            f"| {label} | {res['params'] / 1e6:.2f} M | {res['bytes'] / 2**20:.1f} MiB | {res['save_s']:.3f} | "
            f"{res['checksum_s']:.3f} | {res['checksum_pct_of_save']:.1f} % | {res['verify_s']:.4f} | "
            f"{res['verify_checksums_s']:.3f} | {res['load_s']:.3f} | {res['checksum_pct_of_resume']:.1f} % | "
            f"{res['hash_rate_gb_s']:.2f} GB/s |\n")


def main(argv: list[str]) -> int:
    """CLI entry; returns the exit code (2 for a bad argument or config)."""
    from zerotron.cli_help import OneLineErrorParser
    from zerotron.config import ConfigError, load_config, parse_overrides

    ap = OneLineErrorParser(prog="zerotron bench checkpoint", usage=USAGE,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="TOML config of the run (default: the built-in default model)")
    ap.add_argument("--rounds", type=int, default=5, help="checkpoints written and read (median reported; default 5)")
    ap.add_argument("--dir", default=None, help="where the temporary run directory goes (the disk to measure)")
    ap.add_argument("--blocking", action="store_true",
                    help="measure the training time a save blocks, synchronous vs checkpoint.async_save")
    ap.add_argument("--nproc", type=int, default=1, help="ranks for --blocking (default 1)")
    ap.add_argument("--json", default=None, help="write the result as JSON here")
    ap.add_argument("--markdown", default=None, help="write the one-row table here")
    args, rest = ap.parse_known_args(argv)
    try:
        if args.rounds < 1:
            raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
        if args.nproc < 1 or (args.nproc > 1 and not args.blocking):
            raise ConfigError(f"--nproc {args.nproc}: must be >= 1, and > 1 only with --blocking")
        if args.dir is not None and not Path(args.dir).is_dir():
            raise ConfigError(f"--dir {args.dir} is not a directory; create it or pass another")
        for flag, out in (("--json", args.json), ("--markdown", args.markdown)):
            refusal = out_file_refusal(out, flag, f"results/ckpt.{'json' if flag == '--json' else 'md'}")
            if refusal:
                raise ConfigError(refusal)
        cfg = load_config(args.config, parse_overrides(rest))
        res = (measure_blocking(cfg, args.rounds, args.dir, args.nproc) if args.blocking
               else measure(cfg, args.rounds, args.dir))
    except ConfigError as e:
        print(f"zerotron bench checkpoint: error: {e}", file=sys.stderr)
        return 2
    label = cfg.model.preset or (Path(args.config).stem if args.config else "default")
    table = markdown_blocking(res, label) if args.blocking else markdown(res, label)
    print(table, end="")
    if args.json:
        write_out_file(args.json, json.dumps({"model": label, **res}, indent=1) + "\n")
    if args.markdown:
        title = (f"Training time blocked per checkpoint, sync vs async ({label} model, {args.nproc} ranks"
                 if args.blocking else f"Checkpoint integrity overhead ({label} model, one process")
        write_out_file(args.markdown, f"# {title}, median of {res['rounds']} rounds)\n\n" + table)
    return 0
