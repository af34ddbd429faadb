"""``zerotron serve``'s command line: :func:`parser`, :func:`check_args`, :func:`main` (rank 0
serves HTTP and runs the batcher; the other ranks follow, :mod:`zerotron.serve.follow`)."""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["parser", "check_args", "main"]

BATCHING = ("continuous", "window")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron serve``."""
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron serve", formatter_class=HelpFormatter,
                                description="Serve a checkpoint over HTTP (OpenAI-compatible /v1/completions).")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed at start)")
    p.add_argument("--nproc", type=int, default=0, help="N local processes (dp x tp x pp)")
    p.add_argument("--parallel.tp", dest="tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--parallel.pp", dest="pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--batching", default="continuous", help="continuous: rows join and leave between decode "
                   "steps (Orca/vLLM); window: requests within --batch-window-ms form one batch run to its end")
    p.add_argument("--microbatches", type=int, default=0,
                   help="pipeline micro-batches in flight, --batching window only (0 = pp)")
    p.add_argument("--batch-window-ms", type=float, default=20.0,
                   help="--batching window: requests this close together share a batch")
    p.add_argument("--max-batch", type=int, default=32,
                   help="sequences per batch (window) or running together (continuous) at most")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--model-name", default=None, help="the model id (default: the run directory's name)")
    return p


def check_args(args) -> None:
    """Raise ValueError (one line naming the option and the fix) for a bad option value or combination."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.batching not in BATCHING:
        raise ValueError(f"--batching must be one of {', '.join(BATCHING)}, got {args.batching!r}")
    for name, val, ok, want in (
            ("--parallel.tp", args.tp, args.tp >= 1, ">= 1"), ("--parallel.pp", args.pp, args.pp >= 1, ">= 1"),
            ("--microbatches", args.microbatches, args.microbatches >= 0, ">= 0"),
            ("--max-batch", args.max_batch, args.max_batch >= 1, ">= 1"),
            ("--batch-window-ms", args.batch_window_ms,
             math.isfinite(args.batch_window_ms) and 0 <= args.batch_window_ms <= 60000, "a finite number in [0, 60000]"),
            ("--max-body-bytes", args.max_body_bytes, args.max_body_bytes >= 1, ">= 1")):
        if not ok:
            raise ValueError(f"{name} must be {want}, got {val}")
    if args.batching == "continuous" and args.microbatches > 1:
        raise ValueError(f"--microbatches {args.microbatches} needs --batching window (continuous batching walks "
                         "the pipeline one iteration at a time); drop --microbatches or add --batching window")
    if args.nproc > 1 and args.nproc % (args.tp * args.pp):
        raise ValueError(f"--nproc {args.nproc} must be a multiple of --parallel.tp x --parallel.pp ({args.tp} x {args.pp})")


def main(argv: list[str]) -> int:
    """Entry point of ``zerotron serve``; returns an exit code (2 for bad arguments)."""
    from zerotron.generate import eos_id, load_model, resolve_checkpoint
    from zerotron.launch import in_worker, launch, strip_nproc

    from .http_api import check_listen

    args = parser().parse_args(argv)
    try:
        check_args(args)
        from zerotron.plan import ParallelDims

        # the layout fits the world size: one line here, not a traceback in every rank
        ParallelDims(int(os.environ["WORLD_SIZE"]) if in_worker() else max(1, args.nproc), 0, args.tp, args.pp)
        ckpt = resolve_checkpoint(args.checkpoint)
        if not in_worker():  # the model's heads split over tp: the rule the plan applies, before any worker
            from zerotron.models.layout import tp_refusal
            from zerotron.train.checkpoint import read_meta

            reason = tp_refusal(args.tp, read_meta(ckpt).get("model_config", {}), tp_name="--parallel.tp")
            if reason:
                raise ValueError(reason)
        if not in_worker() or os.environ.get("RANK") == "0":
            check_listen(args.host, args.port)  # before any worker or model is started
        if not in_worker():  # files present and checksums equal, before any worker starts
            from zerotron.train import checkpoint as ck

            ck.verify_checkpoint(ckpt)
        if args.nproc > 1 and not in_worker():
            return launch(args.nproc, ["serve", *strip_nproc(argv)])
    except Exception as e:  # noqa: BLE001 - CheckpointError, ValueError: one line
        print(f"zerotron serve: error: {e}", file=sys.stderr)
        return 2
    from zerotron.distributed import mesh as _mesh
    from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed
    from zerotron.inference import Engine

    from .follow import Channel, follow

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    rank, world, device = init_distributed(timeout_s=600)
    mesh = Mesh(ParallelDims(world, 0, args.tp, args.pp), device)
    model, tok, _ = load_model(ckpt, device)
    engine = Engine(model, mesh, microbatches=args.microbatches or args.pp, eos_id=eos_id(tok), decode=tok.decode)
    code = 0
    if rank != 0:
        follow(engine)
    else:
        code = _serve(args, engine, tok, mesh, world, Channel(world), stop)
    _mesh.teardown()
    return code


def _serve(args, engine, tok, mesh, world: int, channel, stop: threading.Event) -> int:
    """Rank 0: listen, run the batcher until drained; the exit code (2: cannot listen)."""
    from zerotron.generate import eos_id

    from .api import Front
    from .batching import ContinuousScheduler, WindowBatcher
    from .http_api import Listener, make_handler

    model_id = args.model_name or (Path(args.checkpoint).resolve().name)
    front = Front(tok, eos_id(tok), model_id, args.batching)
    try:
        httpd = Listener((args.host, args.port), make_handler(front, args.max_body_bytes))
    except OSError as e:  # taken between the launcher's check and now: one line, the others stop
        print(f"zerotron serve: error: cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose "
              "another --port (0 = any free one) or a --host address of this machine", file=sys.stderr, flush=True)
        channel.send({"kind": "stop"})
        return 2
    if args.batching == "window":
        batcher = WindowBatcher(engine, front, channel, args.batch_window_ms, args.max_batch)
    else:
        batcher = ContinuousScheduler(engine, front, channel, args.max_batch)
    httpd.daemon_threads = False  # server_close waits for responses being written
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    threading.Thread(target=lambda: (stop.wait(), front.draining.set()), daemon=True).start()
    host, port = httpd.server_address[:2]
    print(f"zerotron serve: listening on http://{host}:{port} (model {model_id!r}, {world} rank(s): "
          f"dp {mesh.size('dp')} x tp {args.tp} x pp {args.pp}, {args.batching} batching)", flush=True)
    batcher.run()
    httpd.shutdown()
    httpd.server_close()
    print("zerotron serve: drained and stopped", flush=True)
    return 0
