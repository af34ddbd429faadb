"""``zerotron serve``: an OpenAI-compatible completions server on any inference layout.

Endpoints: ``POST /v1/completions`` (prompt: a string or a list of up to 64 strings; max_tokens
(16, at most 4096), temperature (1.0), top_p (1.0), top_k (zerotron's extension), n (1..16),
stop (a string or up to 4), seed (0), model (optional: must be the served id), stream (false)),
``GET /v1/models``, ``GET /health`` (status, batches decoded, requests
they answered). Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` with 400 (bad
field, bad JSON), 404 (unknown path or model), 413 (body over ``--max-body-bytes``), 503
(draining); the server keeps serving.

Process layout (DESIGN.md "Serving"): rank 0 runs the HTTP server (the standard library's
``ThreadingHTTPServer``: no web framework is installed in this environment) and the batcher;
requests arriving within ``--batch-window-ms`` of each other (up to ``--max-batch`` sequences)
are decoded together: the batch is broadcast to every rank (``broadcast_object``), every rank runs
:meth:`zerotron.inference.Engine.generate`, rank 0 answers. While idle, rank 0 broadcasts a
heartbeat every second, so the other ranks never hit the collective timeout. Choice j of prompt i
is sampled with seed ``seed + i * n + j``: with n = 1 exactly what ``zerotron generate --seed``
gives prompt i, so the texts are equal. ``stop`` strings end generation: every rank decodes the
new tokens after each step and ends a row at the token that completes a stop string (so
``completion_tokens`` counts up to there), and the text is cut before the stop string;
``finish_reason`` is "stop" (eos or a stop string) or "length".

Streaming (``"stream": true``): the answer is OpenAI-style server-sent events (``Content-Type:
text/event-stream``, chunked), one ``data: {...}\n\n`` event per piece of new text as the tokens
are decoded (``choices[0]`` with ``text``, ``index``, ``finish_reason`` null until the choice's
last event), then ``data: [DONE]\n\n``. The pieces concatenate to the non-streamed text: text that
could still turn into a stop string, or an incomplete UTF-8 character, is held back until the
next token decides it. With dp > 1, the choices decoded on other replicas than rank 0's arrive as
one piece when their batch ends (their tokens reach rank 0 only then). Prompts longer than the context are cropped to the last block_size tokens as in
``zerotron generate``.

SIGTERM (or SIGINT): new requests get 503, queued and running batches finish and are answered,
the ranks stop, exit code 0 (under ``--nproc`` the launcher reports the signal: 143).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["main", "parse_completion", "RequestError", "StreamText"]

MAX_N, MAX_STOP, MAX_PROMPTS, MAX_TOKENS = 16, 4, 64, 4096


class RequestError(ValueError):
    """A client error: HTTP ``status``, ``param`` (the offending field or None), message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _num(body: dict, key: str, default, kind, lo=None, hi=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if ok and isinstance(v, float) and v != v:
        ok = False
    if not ok:
        rng = f" in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise RequestError(f"'{key}' must be {'a number' if kind is not int else 'an integer'}{rng}, got {v!r}",
                           param=key)
    return v


def parse_completion(body, model_id: str) -> dict:
    """Validate a /v1/completions JSON body; return ``{"prompts", "max_tokens", "temperature",
    "top_p", "top_k", "n", "stop", "seed", "stream"}``. Raises RequestError (400, or 404 for another model)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("model") not in (None, model_id):
        raise RequestError(f"the model {body['model']!r} does not exist; this server serves {model_id!r}",
                           status=404, param="model", code="model_not_found")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", param="stream")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS or \
            not all(isinstance(p, str) and p for p in prompts):
        raise RequestError(f"'prompt' is required: a non-empty string or a list of 1..{MAX_PROMPTS} non-empty "
                           f"strings, got {prompt!r}"[:300], param="prompt")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP}, got {stop!r}",
                           param="stop")
    top_k = body.get("top_k")
    if top_k is not None:
        top_k = _num(body, "top_k", None, int, lo=1)
    return {"prompts": prompts, "stop": stops, "top_k": top_k, "stream": bool(stream),
            "max_tokens": _num(body, "max_tokens", 16, int, lo=0, hi=MAX_TOKENS),
            "temperature": _num(body, "temperature", 1.0, (int, float), lo=0, hi=100),
            "top_p": _num(body, "top_p", 1.0, (int, float), lo=0, hi=1, lo_open=True),
            "n": _num(body, "n", 1, int, lo=1, hi=MAX_N), "seed": _num(body, "seed", 0, int, lo=0)}


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to (excluding) the earliest stop string; whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_back(text: str, stops: list[str]) -> str:
    """``text`` minus what the next tokens may still change: a trailing incomplete UTF-8 character
    (decoded as U+FFFD) and the longest suffix that is a prefix of a stop string."""
    text = text.rstrip("\ufffd")
    for k in range(min(len(text), max((len(x) for x in stops), default=1) - 1), 0, -1):
        if any(x.startswith(text[-k:]) for x in stops):
            return text[:-k]
    return text


class StreamText:
    """The text of one streamed choice: :meth:`push` each new token id, get the new piece to send
    ("" while held back, see :func:`_held_back`); :meth:`finish` returns the rest. The pieces
    concatenate to ``cut_at_stop(decode(tokens), stops)[0]``, the non-streamed text."""

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops, self.tokens, self.sent = decode, stops, [], ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text, found = cut_at_stop(self.decode(self.tokens), self.stops)
        return self._piece(text if found else _held_back(text, self.stops))

    def finish(self) -> str:
        return self._piece(cut_at_stop(self.decode(self.tokens), self.stops)[0])

    def _piece(self, text: str) -> str:
        if not text.startswith(self.sent):  # the decoder rewrote earlier text: wait for the end
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


class _Job:
    def __init__(self, requests, meta, stream: bool = False):
        self.requests, self.meta, self.done, self.result, self.error = requests, meta, threading.Event(), None, None
        self.events: queue.Queue | None = queue.Queue() if stream else None  # (choice, token), None at the end


class Server:
    """Rank 0's HTTP front end and batcher (see the module docstring)."""

    def __init__(self, engine, tokenizer, eos_id, model_id: str, args):
        self.engine, self.tok, self.eos_id, self.model_id, self.args = engine, tokenizer, eos_id, model_id, args
        self.jobs: queue.Queue = queue.Queue()
        self.draining = threading.Event()
        self.counter = 0
        self.batches = self.batched_jobs = 0  # batches decoded, requests (HTTP) they answered
        self.block_size = engine.config.block_size

    # ---- HTTP side (handler threads) -------------------------------------------------------------
    def _submit(self, body):
        """Validate ``body`` and enqueue its job; (parsed body, requests, job). Raises RequestError."""
        from zerotron.inference import Request, SamplingParams

        if self.draining.is_set():
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        c = parse_completion(body, self.model_id)
        reqs, meta = [], []
        for i, text in enumerate(c["prompts"]):
            ids = self.tok.encode(text).ids
            if not ids:
                raise RequestError(f"prompt {i} is empty after tokenization", param="prompt")
            for j in range(c["n"]):
                reqs.append(Request(ids, SamplingParams(max_tokens=c["max_tokens"], temperature=float(c["temperature"]),
                                                        top_k=c["top_k"], top_p=float(c["top_p"]),
                                                        seed=c["seed"] + i * c["n"] + j, stop=tuple(c["stop"]))))
                meta.append(len(ids))
        job = _Job(reqs, meta, c["stream"])
        self.jobs.put(job)
        return c, reqs, job

    def _finish_reason(self, new: list[int], stops: list[str]) -> str:
        stopped = cut_at_stop(self.tok.decode(new), stops)[1]
        return "stop" if stopped or (bool(new) and new[-1] == self.eos_id) else "length"

    def _head(self) -> dict:
        self.counter += 1
        return {"id": f"cmpl-{self.counter}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_id}

    def complete(self, body) -> dict:
        """Validate, enqueue, wait for the batcher; the OpenAI response dict. Raises RequestError."""
        c, reqs, job = self._submit(body)
        job.done.wait()
        if job.error:
            raise RequestError(job.error, status=500, code="internal_error")
        choices, n_out = [], 0
        for k, (r, new) in enumerate(zip(reqs, job.result)):
            choices.append({"text": cut_at_stop(self.tok.decode(new), c["stop"])[0], "index": k, "logprobs": None,
                            "finish_reason": self._finish_reason(new, c["stop"])})
            n_out += len(new)
        n_in = sum(len(self.tok.encode(t).ids) for t in c["prompts"])
        return {**self._head(), "choices": choices,
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}

    def stream(self, body):
        """Validate and enqueue a ``"stream": true`` body (RequestError now if it is bad); return an
        iterator of the event dicts to send (one piece of text of one choice each, the last of a
        choice with its finish_reason). An engine failure ends it with an ``error`` event."""
        c, reqs, job = self._submit(body)
        head, texts = self._head(), [StreamText(self.tok.decode, c["stop"]) for _ in reqs]

        def chunk(k, text, reason=None):
            return {**head, "choices": [{"text": text, "index": k, "logprobs": None, "finish_reason": reason}]}

        def events():
            while True:
                ev = job.events.get()
                if ev is None:
                    break
                k, tok = ev
                piece = texts[k].push(tok)
                if piece:
                    yield chunk(k, piece)
            if job.error:
                yield {"error": {"message": job.error, "type": "server_error", "param": None, "code": "internal_error"}}
                return
            for k, new in enumerate(job.result):  # tokens not streamed (other dp replicas), then the rest
                for tok in new[len(texts[k].tokens):]:
                    texts[k].push(tok)
                yield chunk(k, texts[k].finish(), self._finish_reason(new, c["stop"]))
        return events()

    # ---- batcher (rank 0's main thread; the only one running collectives) --------------------------
    def batch_loop(self) -> None:
        import torch.distributed as dist

        from zerotron.distributed import comm

        world = dist.get_world_size() if dist.is_initialized() else 1
        bcast = (lambda m: comm.broadcast_object(m, src=0)) if world > 1 else (lambda m: m)
        while True:
            try:
                job = self.jobs.get(timeout=1.0)
            except queue.Empty:
                if self.draining.is_set():
                    break
                bcast({"kind": "idle"})
                continue
            jobs, n = [job], len(job.requests)
            deadline = time.monotonic() + self.args.batch_window_ms / 1e3
            while n < self.args.max_batch:
                try:
                    nxt = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                jobs.append(nxt)
                n += len(nxt.requests)
            reqs = [r for j in jobs for r in j.requests]
            owner = [(j, k) for j in jobs for k in range(len(j.requests))]
            self.batches, self.batched_jobs = self.batches + 1, self.batched_jobs + len(jobs)
            bcast({"kind": "batch", "requests": reqs})

            def on_token(i, tok):
                j, k = owner[i]
                if j.events is not None:
                    j.events.put((k, tok))
            try:
                outs = self.engine.generate(reqs, on_token=on_token)
            except Exception as e:  # noqa: BLE001 - answered as 500, the server goes on
                outs, err = None, f"{type(e).__name__}: {e}"
            for j in jobs:
                if outs is None:
                    j.error = err
                else:
                    j.result, outs = outs[:len(j.requests)], outs[len(j.requests):]
                j.done.set()
                if j.events is not None:
                    j.events.put(None)
        bcast({"kind": "stop"})
        while not self.jobs.empty():  # enqueued while the drain began: refused, never left waiting
            j = self.jobs.get()
            j.error = "the server is shutting down"
            j.done.set()
            if j.events is not None:
                j.events.put(None)


def _handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # quiet: one line per request would flood the logs
            pass

        def _send(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client left: nothing to answer
                pass

        def _error(self, e: RequestError) -> None:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}})

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "draining" if server.draining.is_set() else "ok",
                                 "batches": server.batches, "requests": server.batched_jobs})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.model_id, "object": "model",
                                                              "created": 0, "owned_by": "zerotron"}]})
            else:
                self._error(RequestError(f"no route GET {self.path}", status=404))

        def do_POST(self):
            if self.path != "/v1/completions":
                self._error(RequestError(f"no route POST {self.path}", status=404))
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if length < 0 or length > server.args.max_body_bytes:
                self.close_connection = True
                self._error(RequestError(f"the body must have a Content-Length of at most "
                                         f"{server.args.max_body_bytes} bytes", status=413))
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                self._error(RequestError(f"the body is not valid JSON: {e}"))
                return
            try:
                if isinstance(body, dict) and body.get("stream") is True:
                    self._stream(server.stream(body))
                else:
                    self._send(200, server.complete(body))
            except RequestError as e:
                self._error(e)

        def _stream(self, events) -> None:
            """Server-sent events, HTTP/1.1 chunked: one ``data: {json}`` per event, then [DONE]."""
            def write(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for ev in events:
                    write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                write(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client left: the batch goes on
                self.close_connection = True

    return Handler


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron serve``."""
    from .cli_help import HelpFormatter

    p = argparse.ArgumentParser(prog="zerotron serve", formatter_class=HelpFormatter,
                                description="Serve a checkpoint over HTTP (OpenAI-compatible /v1/completions).")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed at start)")
    p.add_argument("--nproc", type=int, default=0, help="N local processes (dp x tp x pp)")
    p.add_argument("--parallel.tp", dest="tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--parallel.pp", dest="pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches in flight (0 = pp)")
    p.add_argument("--batch-window-ms", type=float, default=20.0, help="requests this close together share a batch")
    p.add_argument("--max-batch", type=int, default=32, help="sequences per batch at most")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--model-name", default=None, help="the model id (default: the run directory's name)")
    return p


def check_args(args) -> None:
    """Raise ValueError (one line) for a bad option value."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    import math

    for name, val, ok in (("--parallel.tp", args.tp, args.tp >= 1), ("--parallel.pp", args.pp, args.pp >= 1),
                          ("--microbatches", args.microbatches, args.microbatches >= 0),
                          ("--max-batch", args.max_batch, args.max_batch >= 1),
                          ("--batch-window-ms", args.batch_window_ms,
                           math.isfinite(args.batch_window_ms) and 0 <= args.batch_window_ms <= 60000),
                          ("--max-body-bytes", args.max_body_bytes, args.max_body_bytes >= 1)):
        if not ok:
            want = {"--parallel.tp": ">= 1", "--parallel.pp": ">= 1", "--microbatches": ">= 0", "--max-batch": ">= 1",
                    "--batch-window-ms": "a finite number in [0, 60000]", "--max-body-bytes": ">= 1"}[name]
            raise ValueError(f"{name} must be {want}, got {val}")
    if args.nproc > 1 and args.nproc % (args.tp * args.pp):
        raise ValueError(f"--nproc {args.nproc} must be a multiple of --parallel.tp x --parallel.pp ({args.tp} x {args.pp})")


class _Listener(ThreadingHTTPServer):
    """The HTTP server with a listen backlog for bursts of clients (socketserver's default of 5
    resets connections beyond it)."""

    request_queue_size = 256


def check_listen(host: str, port: int) -> None:
    """Raise ValueError (one line naming the address and the fix) if this process cannot listen
    on ``host``:``port`` (a port in use, an address of another machine, a name that does not
    resolve); binds and closes a socket the way ``ThreadingHTTPServer`` does (SO_REUSEADDR)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(infos[0][4])
    except OSError as e:
        why = e.strerror or str(e)
        raise ValueError(f"cannot listen on {host}:{port} ({why}); choose another --port (0 = any free one) "
                         "or a --host address of this machine") from None


def main(argv: list[str]) -> int:
    """Entry point of ``zerotron serve``; returns an exit code (2 for bad arguments)."""
    from .generate import eos_id, load_model, resolve_checkpoint
    from .launch import in_worker, launch, strip_nproc

    args = parser().parse_args(argv)
    try:
        check_args(args)
        ckpt = resolve_checkpoint(args.checkpoint)
        if not in_worker() or os.environ.get("RANK") == "0":
            check_listen(args.host, args.port)  # before any worker or model is started
        if not in_worker():  # files present and checksums equal, before any worker starts
            from .train import checkpoint as ck

            ck.verify_checkpoint(ckpt)
        if args.nproc > 1 and not in_worker():
            return launch(args.nproc, ["serve", *strip_nproc(argv)])
    except Exception as e:  # noqa: BLE001 - CheckpointError, ValueError: one line
        print(f"zerotron serve: error: {e}", file=sys.stderr)
        return 2
    from .distributed import comm
    from .distributed import mesh as _mesh
    from .distributed.mesh import Mesh, ParallelDims, init_distributed
    from .inference import Engine

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    rank, world, device = init_distributed(timeout_s=600)
    mesh = Mesh(ParallelDims(world, 0, args.tp, args.pp), device)
    model, tok, _ = load_model(ckpt, device)
    engine = Engine(model, mesh, microbatches=args.microbatches or args.pp, eos_id=eos_id(tok), decode=tok.decode)
    if rank != 0:
        while True:
            msg = comm.broadcast_object(None, src=0)
            if msg["kind"] == "stop":
                break
            if msg["kind"] == "batch":
                try:
                    engine.generate(msg["requests"])
                except Exception:  # noqa: BLE001 - rank 0 fails the same way and answers 500
                    pass
    else:
        model_id = args.model_name or (Path(args.checkpoint).resolve().name)
        srv = Server(engine, tok, eos_id(tok), model_id, args)
        try:
            httpd = _Listener((args.host, args.port), _handler(srv))
        except OSError as e:  # taken between the launcher's check and now: one line, the others stop
            print(f"zerotron serve: error: cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose "
                  "another --port (0 = any free one) or a --host address of this machine", file=sys.stderr, flush=True)
            if world > 1:
                comm.broadcast_object({"kind": "stop"}, src=0)
            _mesh.teardown()
            return 2
        httpd.daemon_threads = False  # server_close waits for responses being written
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        threading.Thread(target=lambda: (stop.wait(), srv.draining.set()), daemon=True).start()
        host, port = httpd.server_address[:2]
        print(f"zerotron serve: listening on http://{host}:{port} (model {model_id!r}, {world} rank(s): "
              f"dp {mesh.size('dp')} x tp {args.tp} x pp {args.pp})", flush=True)
        srv.batch_loop()
        httpd.shutdown()
        httpd.server_close()
        print("zerotron serve: drained and stopped", flush=True)
    _mesh.teardown()
    return 0
