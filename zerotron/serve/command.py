"""``zerotron serve``'s command line: :func:`parser`, :func:`check_args`, :func:`main` (rank 0
serves HTTP and runs the batcher; the other ranks follow, :mod:`zerotron.serve.follow`)."""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["parser", "check_args", "main", "api_key_of"]

BATCHING = ("continuous", "window")
FRONTENDS = ("process", "thread")  # where the HTTP side runs: zerotron.serve.link (default), or a thread of rank 0
API_KEY_ENV = "ZEROTRON_API_KEY"
DRAINED_ENV = "ZEROTRON_SERVE_DRAINED"  # under --nproc: the file rank 0 writes once drained (exit 0)
KV_PAGE = 8  # = zerotron.inference.continuous.DEFAULT_PAGE (not imported here: that module imports torch)


PEER_LOST = "the server stopped (a rank it needs is gone): start `zerotron serve` again"

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
    p.add_argument("--parallel.ep", dest="ep", type=int, default=1,
                   help="expert-parallel degree (mixture-of-experts models: each of ep ranks holds E/ep experts)")
    p.add_argument("--ep-split", choices=("replica", "tokens"), default="replica",
                   help="how an ep group shares decoding: replica (its ranks decode the same rows, outputs all-gathered) or tokens (each rank its own rows, tokens sent to their experts by all-to-all)")
    p.add_argument("--batching", default="continuous", help="continuous: rows join and leave between decode "
                   "steps (Orca/vLLM); window: requests within --batch-window-ms form one batch run to its end")
    p.add_argument("--microbatches", type=int, default=0,
                   help="pipeline micro-batches in flight, --batching window only (0 = pp)")
    p.add_argument("--batch-window-ms", type=float, default=20.0,
                   help="--batching window: requests this close together share a batch")
    p.add_argument("--max-batch", type=int, default=32,
                   help="sequences per batch (window) or running together (continuous) at most")
    p.add_argument("--kv-cache-mb", type=float, default=0.0,
                   help="paged KV cache per rank, MiB (--batching continuous; 0: room for 32 full-context rows)")
    p.add_argument("--kv-page", type=int, default=KV_PAGE, help="tokens per KV cache block (page)")
    p.add_argument("--max-step-tokens", type=int, default=2048,
                   help="token budget of one continuous-batching step: decoding rows first, then chunked prefill")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not reuse the KV blocks of prompt prefixes seen before")
    p.add_argument("--speculative", default="", help="speculative decoding (--batching continuous): 'ngram' "
                   "(prompt lookup, no draft model) or 'draft:DIR' (a small checkpoint with the same tokenizer)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per decoding row and step")
    p.add_argument("--adapter", default="", help="a peft LoRA adapter directory (adapter_config.json + "
                   "adapter_model.safetensors: peft save_pretrained or zerotron export --adapter) folded into the "
                   "checkpoint's weights before serving")
    p.add_argument("--compile", action="store_true", help="compiled decode steps (single process and data "
                   "parallel; continuous: one graph, dynamic shapes, compiled at start-up: "
                   "zerotron.inference.paged_compiled; window: static shapes, zerotron.inference.compiled)")
    p.add_argument("--frontend", default="process", help="process: HTTP, tokenisation and streamed events in a "
                   "process of their own, so the engine loop never waits for them (vLLM V1's layout; 1.3x the tokens/s "
                   "of thread at 16 clients, idle 2-core machine); thread: HTTP in a thread of rank 0's process "
                   "(one process fewer)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--model-name", default=None, help="the model id (default: the run directory's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but "
                   f"/health (default: ${API_KEY_ENV}; unset: no key)")
    return p


def check_args(args) -> None:
    """Raise ValueError (one line naming the option and the fix) for a bad option value or combination."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty (an unset shell variable?): pass the key clients must send, or leave "
                         "--api-key out to serve without one")
    if args.model_name is not None and not args.model_name.strip():
        raise ValueError("--model-name is empty: pass the model id clients send, or leave it out for the run "
                         "directory's name")
    if args.batching not in BATCHING:
        raise ValueError(f"--batching must be one of {', '.join(BATCHING)}, got {args.batching!r}")
    if args.frontend not in FRONTENDS:
        raise ValueError(f"--frontend must be one of {', '.join(FRONTENDS)}, got {args.frontend!r}")
    for name, val, ok, want in (
            ("--parallel.tp", args.tp, args.tp >= 1, ">= 1"), ("--parallel.pp", args.pp, args.pp >= 1, ">= 1"),
            ("--microbatches", args.microbatches, args.microbatches >= 0, ">= 0"),
            ("--max-batch", args.max_batch, args.max_batch >= 1, ">= 1"),
            ("--kv-cache-mb", args.kv_cache_mb, math.isfinite(args.kv_cache_mb) and args.kv_cache_mb >= 0,
             "a finite number >= 0"),
            ("--kv-page", args.kv_page, args.kv_page >= 1, ">= 1"),
            ("--max-step-tokens", args.max_step_tokens, args.max_step_tokens >= 1, ">= 1"),
            ("--batch-window-ms", args.batch_window_ms,
             math.isfinite(args.batch_window_ms) and 0 <= args.batch_window_ms <= 60000, "a finite number in [0, 60000]"),
            ("--max-body-bytes", args.max_body_bytes, args.max_body_bytes >= 1, ">= 1")):
        if not ok:
            raise ValueError(f"{name} must be {want}, got {val}")
    if args.speculative and not (args.speculative == "ngram" or args.speculative.startswith("draft:")):
        raise ValueError(f"--speculative must be 'ngram' or 'draft:DIR', got {args.speculative!r}")
    if args.speculative and args.batching != "continuous":
        raise ValueError("--speculative needs --batching continuous; drop --speculative or --batching window")
    paged = [o for o, on in (("--kv-cache-mb", args.kv_cache_mb != 0.0), ("--kv-page", args.kv_page != KV_PAGE),
                             ("--max-step-tokens", args.max_step_tokens != 2048),
                             ("--no-prefix-cache", not args.prefix_cache)) if on]
    if paged and args.batching != "continuous":
        raise ValueError(f"{', '.join(paged)} {'configure' if len(paged) > 1 else 'configures'} the paged KV cache "
                         "of --batching continuous; drop "
                         f"{'them' if len(paged) > 1 else 'it'} or use --batching continuous")
    if args.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if args.batching == "continuous" and args.microbatches > 1:
        raise ValueError(f"--microbatches {args.microbatches} needs --batching window (continuous batching walks "
                         "the pipeline one iteration at a time); drop --microbatches or add --batching window")
    if getattr(args, "compile", False):
        from zerotron.inference.compiled import compile_refusal
        reason = compile_refusal(args.tp, args.pp, args.ep)
        if reason:
            raise ValueError(reason)
    if args.nproc < 0:
        raise ValueError(f"--nproc must be >= 0 (0 or 1: this process alone), got {args.nproc}")
    if args.nproc > 1 and args.nproc % (args.tp * args.pp):
        raise ValueError(f"--nproc {args.nproc} must be a multiple of --parallel.tp x --parallel.pp ({args.tp} x {args.pp})")


def api_key_of(args, env=None) -> str | None:
    """The API key clients must send: ``--api-key``, else ``$ZEROTRON_API_KEY``; None (no key
    required) when neither is set or both are empty."""
    env = os.environ if env is None else env
    return args.api_key or env.get(API_KEY_ENV) or None


def main(argv: list[str]) -> int:
    """Entry point of ``zerotron serve``; returns an exit code (2 for bad arguments)."""
    from zerotron.generate import resolve_checkpoint
    from zerotron.launch import launch, strip_nproc
    from zerotron.launch_worker import in_worker, say_once

    from .http_api import check_listen

    args = parser().parse_args(argv)
    try:
        check_args(args)
        from zerotron.plan import ParallelDims

        # the layout fits the world size: one line here, not a traceback in every rank
        ParallelDims(int(os.environ["WORLD_SIZE"]) if in_worker() else max(1, args.nproc), 0, args.tp, args.pp)
        ckpt = resolve_checkpoint(args.checkpoint)
        if args.speculative.startswith("draft:"):
            resolve_checkpoint(args.speculative[len("draft:"):])  # there: one line now, not in every rank
        if not in_worker():  # the model's heads split over tp: the rule the plan applies, before any worker
            from zerotron.models.layout import ep_inference_refusal, tp_refusal
            from zerotron.train.checkpoint import read_meta

            model_cfg = read_meta(ckpt).get("model_config", {})
            reason = (tp_refusal(args.tp, model_cfg, tp_name="--parallel.tp")
                      or ep_inference_refusal(args.ep, max(1, args.nproc), args.tp, args.pp, model_cfg,
                                              split=args.ep_split))
            if reason:
                raise ValueError(reason)
        if not in_worker() or os.environ.get("RANK") == "0":
            check_listen(args.host, args.port)  # before any worker or model is started
        if not in_worker():  # files present and checksums equal, before any worker starts
            from zerotron.train import checkpoint as ck

            ck.verify_checkpoint(ckpt)
            if args.adapter:  # names, shapes and ranks fit the checkpoint's model: one line, no worker
                from zerotron.generate import check_adapter

                check_adapter(ckpt, args.adapter)
        if args.nproc > 1 and not in_worker():
            return _launch(args.nproc, ["serve", *strip_nproc(argv)], launch)
    except Exception as e:  # noqa: BLE001 - CheckpointError, ValueError: one line (once for all workers)
        say_once(f"zerotron serve: error: {e}")
        return 2
    stop, started = threading.Event(), threading.Event()

    def on_signal(sig, _frame):
        stop.set()  # serving: drain
        if not started.is_set() and not in_worker():  # one process starting (model load, minutes of compiling):
            # give up at once (workers of --nproc still finish starting, then drain together)
            started.set()  # a second signal while unwinding only sets stop
            raise StartupStopped(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    link = None
    if args.frontend == "process" and (not in_worker() or os.environ.get("RANK") == "0"):
        from .link import spawn_frontend

        link = spawn_frontend()  # it imports its modules while this process loads the model
    try:
        return _run(args, ckpt, stop, link, started)
    except StartupStopped as e:  # was: the whole compile (minutes) ran on, then "listening on", then the drain
        print(f"zerotron serve: stopped by {signal.Signals(e.args[0]).name} while starting (loading the model or "
              "compiling); nothing was served", file=sys.stderr, flush=True)
        return 0
    finally:
        if link is not None and link.proc.poll() is None:
            link.close()


class StartupStopped(BaseException):
    """A SIGTERM or SIGINT before this rank serves (raised by the signal handler: a BaseException,
    so that no ``except Exception`` on the way, torch's included, takes it); ``args[0]``: the signal."""


def _run(args, ckpt, stop: threading.Event, link, started: threading.Event) -> int:
    """Every rank: load the model, then serve (rank 0) or follow; the exit code. ``started`` is set
    when this rank begins to serve: a signal before it abandons the start-up (:class:`StartupStopped`)."""
    from zerotron.distributed import mesh as _mesh
    from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed
    from zerotron.distributed.watchdog import CollectiveError
    from zerotron.generate import load_model, resolve_checkpoint, stop_ids
    from zerotron.inference import Engine

    from .follow import Channel, follow

    if args.compile:  # before the first compile: every rank and every restart reuse what the first one built
        from zerotron.parallel.compile import use_cache_dir

        cache = compile_cache_dir(ckpt)
        if cache is not None:
            use_cache_dir(str(cache))
    rank, world, device = init_distributed(timeout_s=600)
    mesh = Mesh(ParallelDims(world, 0, args.tp, args.pp), device)
    model, tok, _ = load_model(ckpt, device, adapter=args.adapter or None)
    engine = Engine(model, mesh, microbatches=args.microbatches or args.pp, eos_id=stop_ids(ckpt, tok), decode=tok.decode,
                    ep=args.ep, compile=args.compile, ep_split=args.ep_split)
    paged = paged_options(args, engine)
    if args.speculative.startswith("draft:"):
        paged["draft_model"] = load_model(resolve_checkpoint(args.speculative[len("draft:"):]), device)[0].eval()
    code = 0
    try:
        if rank != 0:
            started.set()
            follow(engine, paged)
        else:
            code = _serve(args, engine, tok, mesh, world, Channel(world), stop, ckpt, paged, link, started)
    except CollectiveError as e:  # a rank died or hung: the others cannot serve without it (no teardown:
        # its barrier would wait for the lost rank too)
        print(f"zerotron serve: error{f' on rank {rank}' if rank else ''}: {e}; {PEER_LOST}", file=sys.stderr,
              flush=True)
        return 1
    _mesh.teardown()
    if rank == 0 and code == 0 and os.environ.get(DRAINED_ENV):
        Path(os.environ[DRAINED_ENV]).write_text("drained\n")
    return code


def compile_cache_dir(ckpt: Path) -> Path | None:
    """Where ``serve --compile`` keeps Inductor's on-disk caches: ``<run dir>/inductor_cache``, the
    training run's own (``train.compile``), the run directory being the one of checkpoint directory
    ``ckpt`` (``RUN/checkpoints/step_N`` -> ``RUN``), created if needed; None for a step directory
    outside a run (nothing is written beside or into a checkpoint) or where the cache cannot be
    created (a read-only run), which leaves Inductor's default (a directory under the system's
    temporary one). ``TORCHINDUCTOR_CACHE_DIR``, when set, wins
    (:func:`zerotron.parallel.compile.use_cache_dir`)."""
    if ckpt.parent.name != "checkpoints":
        return None
    cache = ckpt.parent.parent / "inductor_cache"
    try:
        cache.mkdir(exist_ok=True)
    except OSError:
        return None
    return cache if os.access(cache, os.W_OK) else None


def paged_options(args, engine) -> dict:
    """The ``ContinuousDecoder`` options of ``args`` (the same on every rank): the block count
    that ``--kv-cache-mb`` holds on the rank with the most KV per block (0: the decoder's default)."""
    from zerotron.inference.continuous import kv_block_bytes

    blocks = None
    if args.kv_cache_mb > 0:
        blocks = int(args.kv_cache_mb * 2**20) // kv_block_bytes(engine, args.kv_page)
    return {"num_blocks": blocks, "page": args.kv_page, "prefix_caching": args.prefix_cache,
            "max_step_tokens": args.max_step_tokens,
            "speculative": args.num_speculative_tokens if args.speculative else 0,
            "compile": bool(getattr(args, "compile", False)) and args.batching == "continuous"}


def _launch(nproc: int, argv: list[str], launch) -> int:
    """Start the ``nproc`` workers; a SIGTERM/SIGINT that the workers answered by draining (rank 0
    wrote the :data:`DRAINED_ENV` file) is a clean stop: exit code 0, not 128 + the signal."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zerotron-serve-") as d:
        note = Path(d) / "drained"
        os.environ[DRAINED_ENV] = str(note)
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                code = launch(nproc, argv)
        finally:
            os.environ.pop(DRAINED_ENV, None)
        if code in (128 + signal.SIGTERM, 128 + signal.SIGINT) and note.exists():
            return 0
        sys.stderr.write(err.getvalue())
        return code


def _serve(args, engine, tok, mesh, world: int, channel, stop: threading.Event, ckpt, paged: dict,
           link=None, started: threading.Event | None = None) -> int:
    """Rank 0: listen, run the batcher until drained; the exit code (2: cannot listen or a bad
    chat template; 1: the HTTP front-end process failed; a rank that died or hung raises CollectiveError). ``link``: the front-end process
    (:class:`~zerotron.serve.link.FrontendLink`) of ``--frontend process``, None for ``thread``."""
    from zerotron.distributed.watchdog import CollectiveError
    from zerotron.generate import stop_ids

    from .api import Front
    from .batching import ContinuousScheduler, WindowBatcher
    from .chat import ChatTemplate, load_chat_template
    from .http_api import ServerThread, bind, make_app

    model_id = args.model_name or (Path(args.checkpoint).resolve().name)
    try:
        eos = stop_ids(ckpt, tok)
        chat = ChatTemplate(load_chat_template(ckpt), tok.id_to_token(eos[0]) if eos else "")
        sock = bind(args.host, args.port)  # taken between the launcher's check and now: one line, the others stop
    except Exception as e:  # noqa: BLE001 - ValueError, a template syntax error: one line
        print(f"zerotron serve: error: {e}", file=sys.stderr, flush=True)
        channel.send({"kind": "stop"})
        return 2
    api_key = api_key_of(args)
    if link is None:
        front = Front(tok, eos or None, model_id, args.batching, chat=chat, context=engine.config.block_size,
                      vocab=engine.config.vocab_size)
    else:
        from .link import RemoteFront

        front = RemoteFront(link, stop)
    kv_line = ""
    if args.batching == "window":
        batcher = WindowBatcher(engine, front, channel, args.batch_window_ms, args.max_batch)
    else:
        from zerotron.inference.continuous import kv_block_bytes

        if paged.get("compile"):  # minutes of silence otherwise (SIGTERM stops it: StartupStopped)
            print("zerotron serve: compiling the decode step (minutes the first time, then cached) ...",
                  file=sys.stderr, flush=True)
        try:
            batcher = ContinuousScheduler(engine, front, channel, args.max_batch, paged)
        except ValueError as e:  # the pool cannot hold one row, or exceeds the memory: one line, the others stop
            print(f"zerotron serve: error: --kv-cache-mb {args.kv_cache_mb:g}, --kv-page {args.kv_page}: {e}",
                  file=sys.stderr, flush=True)
            channel.send({"kind": "stop"})
            return 2
        d = batcher.decoder
        kv_line = (f"\nzerotron serve: KV cache: {d.num_blocks} blocks of {d.page} tokens per dp replica "
                   f"({d.num_blocks * kv_block_bytes(engine, d.page) / 2**20:.1f} MiB on the fullest rank; "
                   f"{d.num_blocks * d.page} tokens), prefix caching {'on' if args.prefix_cache else 'off'}"
                   + (f", speculative {args.speculative} x {args.num_speculative_tokens}" if args.speculative else ""))
    host, port = sock.getsockname()[:2]
    if started is not None:
        started.set()  # from here a signal drains
    if link is None:
        server = ServerThread(make_app(front, args.max_body_bytes, api_key), sock)
        server.start()
        threading.Thread(target=lambda: (stop.wait(), front.draining.set()), daemon=True).start()
    else:
        try:
            link.start({"tokenizer": tok.to_str(), "eos": eos or None, "eos_token": chat.eos,
                        "chat_template": None if chat.builtin else chat.source, "model_id": model_id,
                        "batching": args.batching, "context": engine.config.block_size,
                        "vocab": engine.config.vocab_size,
                        "max_body_bytes": args.max_body_bytes, "api_key": api_key,
                        "stats": dict(vars(front.stats))}, sock)
        except RuntimeError as e:
            print(f"zerotron serve: error: {e}", file=sys.stderr, flush=True)
            channel.send({"kind": "stop"})
            return 1
        sock.close()  # the front end holds its own copy
    print(f"zerotron serve: listening on http://{host}:{port} (model {model_id!r}, {world} rank(s): "
          f"dp {mesh.size('dp')} x tp {args.tp} x pp {args.pp}" + (f" (ep {args.ep}, {args.ep_split} split)" if args.ep > 1 else "") + f", {args.batching} batching"
          f"{', LoRA adapter ' + repr(args.adapter) + ' merged' if args.adapter else ''}"
          f"{', API key required' if api_key else ''}{', HTTP in its own process' if link else ''}; chat template: "
          f"{'built-in default' if chat.builtin else 'the tokenizer' + chr(39) + 's'}){kv_line}", flush=True)
    try:
        batcher.run()
    except CollectiveError:  # a rank died or hung mid-step: the HTTP side stops, _run says why
        if link is None:
            server.stop()
        else:
            link.close(timeout_s=10)  # its open requests are answered (the server is stopping)
        raise
    if link is None:
        server.stop()  # idle keep-alive connections close now; answers being written finish first
    else:
        code = link.close()  # the same, in the front end
        if front.lost:
            print(f"zerotron serve: error: the HTTP front-end process exited (code {code}); its requests were "
                  "cancelled and the server stopped", file=sys.stderr, flush=True)
            return 1
    print("zerotron serve: drained and stopped", flush=True)
    return 0
