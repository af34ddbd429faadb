"""The HTTP layer of ``zerotron serve`` (rank 0): a FastAPI app (:func:`make_app`) served by
uvicorn in a thread (:class:`ServerThread`) while the main thread runs the batcher.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``,
``GET /health``, ``GET /metrics`` (Prometheus text; :mod:`~zerotron.serve.metrics`); HEAD on
the GET routes. Every error is JSON in OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``: 400 bad JSON or a bad field (named in ``param``), 401 a missing or wrong API key,
404 an unknown path or model, 405 another method (with ``Allow``), 408 a body that stops
arriving for ``read_timeout_s`` or a request head not complete within it, 413 a body over ``max_body_bytes`` (the connection is closed:
its body is unread), 503 while draining; a keep-alive connection goes on after any of them. A
request uvicorn's parser refuses (a malformed request line or header) gets a JSON 400 too
(:func:`http_protocol`), and that connection closes.

With ``api_key``, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.

A waiting handler is woken by the batcher (``Job.wake``) and checks every ``POLL_S`` that its
client is still connected (``Request.is_disconnected``); a client that left, or a stream that
can no longer be written, cancels the job."""
from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading

from fastapi import Request

from .api import Front, Streamer, sse
from .validation import RequestError

__all__ = ["make_app", "ServerThread", "check_listen", "bind", "POLL_S"]

POLL_S = 0.25  # how often a waiting handler checks that its client is still connected
DRAIN_BYTES = 8 << 20  # a declared body over the limit but at most this is read and dropped before the 413
ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET", "/health": "GET",
          "/metrics": "GET"}


def _error_json(status: int, message: str, param=None, code=None) -> dict:
    kind = {401: "authentication_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


BAD_HTTP = ("invalid HTTP request: the request line or a header could not be parsed (for example a Content-Length "
            "that is not a non-negative integer); send a well-formed HTTP/1.1 request")


def _unparsed(protocol) -> bool:
    """Whether uvicorn's h11 protocol holds received bytes its parser has not made a request of yet
    (the start of a pipelined request head; h11's ``trailing_data``). False for httptools, which
    parses every byte as it arrives."""
    conn = getattr(protocol, "conn", None)
    return bool(getattr(conn, "trailing_data", (b"",))[0])


def http_protocol(head_timeout_s: float = 60.0):
    """uvicorn's HTTP/1.1 protocol class as its ``http="auto"`` picks it (httptools if installed,
    else h11), with the responses that never reach the app in OpenAI's JSON error shape:

    - the 400 to a request its parser refuses (a malformed request line or header, e.g.
      ``Content-Length: -1``; code ``invalid_http_request``) instead of uvicorn's plain text; the
      connection closes after it, as uvicorn's own does (the parser cannot resynchronise);
    - a request head (request line and headers) not complete ``head_timeout_s`` after the
      connection opened, or after the first byte that followed the previous answer, gets 408
      (code ``request_timeout``) and the connection closes; a new connection that sent nothing by
      then is closed without an answer (an idle keep-alive connection is left to uvicorn's
      ``timeout_keep_alive``). uvicorn itself times out neither (its keep-alive timer stops at the
      first byte of the next request, and a new connection has none), so a client that opens
      connections and sends a few header bytes now and then (slowloris) held each of them, and
      its file descriptor, for as long as it liked."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonErrorProtocol(AutoHTTPProtocol):
        _head_timer = None

        def send_400_response(self, msg: str) -> None:  # uvicorn's hook for unparsable requests
            self._close_with(400, BAD_HTTP, "invalid_http_request")

        def _close_with(self, status: int, message: str, code: str) -> None:
            body = json.dumps(_error_json(status, message, code=code)).encode()
            reason = {400: b"Bad Request", 408: b"Request Timeout"}[status]
            head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
            head += [n + b": " + v + b"\r\n" for n, v in self.server_state.default_headers]
            head += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                     % len(body)]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

        def _arm_head_timer(self, got_bytes: bool) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle, self._head_bytes = self.cycle, got_bytes
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not self._head_cycle or \
                    (self.cycle is not None and not self.cycle.response_complete):
                return  # a request head arrived (its cycle is the app's now), or an answer is still being sent
            if self._head_bytes:
                self._close_with(408, f"the request head (request line and headers) did not arrive within "
                                      f"{head_timeout_s:g} s", "request_timeout")
            else:
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_due = False
            self._arm_head_timer(False)  # a new connection: its first request head is due

        def data_received(self, data: bytes) -> None:
            if self._head_due:  # the first byte after an answer: the next head's clock starts (an idle
                self._head_due = False  # keep-alive connection is uvicorn's timeout_keep_alive's to close)
                self._arm_head_timer(True)
            elif self._head_timer is not None:
                self._head_bytes = True
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.cycle is not None and self.cycle.response_complete and _unparsed(self):
                self._arm_head_timer(True)  # the start of a pipelined head came with the last request
            else:
                self._head_due = True

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return JsonErrorProtocol


class _Guard:
    """ASGI middleware: the API key check (401) and the ``zerotron_requests_total`` count."""

    def __init__(self, app, front: Front, api_key: str | None, read_timeout_s: float = 60.0):
        self.app, self.front, self.key = app, front, api_key.encode() if api_key else None
        self.read_timeout_s = read_timeout_s  # also the request head's limit (ServerThread: http_protocol)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ROUTES else "other"
        status = [0]

        async def counted(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                self.front.metrics.request(endpoint, msg["status"])
            await send(msg)

        if self.key is not None and path != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not (auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.key)):
                body = json.dumps(_error_json(401, "a valid API key is required: send 'Authorization: Bearer "
                                                   "<key>'", code="invalid_api_key")).encode()
                await _drain(receive)
                await counted({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""})
                return
        await self.app(scope, receive, counted)


async def _drain(receive) -> None:
    """Read (and drop) a request body, so the connection can serve the next request."""
    while True:
        msg = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body"):
            return


def make_app(front: Front, max_body_bytes: int, api_key: str | None = None, read_timeout_s: float = 60.0):
    """The ASGI app serving ``front``: bodies of at most ``max_body_bytes`` (413 beyond), a body
    that stops arriving for ``read_timeout_s`` gets 408 (and a request head that has not arrived
    within it, when :class:`ServerThread` serves the app: :func:`http_protocol`), ``api_key``: see
    the module docstring."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    app = FastAPI(title="zerotron serve", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: RequestError, headers=None) -> JSONResponse:
        return JSONResponse(_error_json(e.status, str(e), e.param, e.code), status_code=e.status, headers=headers)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return error(e, {"Connection": "close"} if e.status in (408, 413) else None)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):  # unknown path (404), another method (405)
        method, path = request.method, request.url.path
        if e.status_code == 405:
            msg = f"method {method} is not allowed on {path}; use {ROUTES.get(path, 'GET')}"
        elif e.status_code == 404:
            msg = f"no route {method} {path}"
        else:
            msg = str(e.detail)
        return JSONResponse(_error_json(e.status_code, msg), status_code=e.status_code, headers=e.headers)

    async def _drain(request: Request) -> None:
        async for _ in request.stream():
            pass

    async def body_of(request: Request):
        """The JSON body; RequestError 413 (too large), 408 (stalled), 400 (not JSON), 499 (the
        client went away before its body arrived: nobody reads the answer, nothing is logged)."""
        too_big = RequestError(f"the body must be at most {max_body_bytes} bytes", status=413)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            if not length.isdigit():
                raise RequestError(f"Content-Length must be an integer, got {length!r}"[:200])
            if int(length) <= DRAIN_BYTES:  # read it first: a close with the body unread resets the
                try:                         # connection, and the client can lose the 413 with it
                    await asyncio.wait_for(_drain(request), read_timeout_s)
                except asyncio.TimeoutError:
                    pass
            raise too_big

        async def read() -> bytes:
            out = bytearray()
            async for piece in request.stream():
                out += piece
                if len(out) > max_body_bytes:
                    raise too_big
            return bytes(out)
        try:
            raw = await asyncio.wait_for(read(), read_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {read_timeout_s:g} s", status=408) from None
        except ClientDisconnect:  # before: an "Exception in ASGI application" traceback in the server's log
            raise RequestError("the client disconnected before its request body arrived", status=499,
                               code="client_disconnected") from None
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None
        except RecursionError:  # arrays/objects nested about 1000 deep
            raise RequestError("the body is not valid JSON for this server: it is nested too deeply "
                               "(RecursionError)") from None
        except ValueError as e:  # an integer of more than 4300 digits (Python's int conversion limit)
            raise RequestError(f"the body is not valid JSON for this server: {str(e).split(';')[0]}"[:300]) from None

    async def wait(request: Request, job) -> bool:
        """Wait for ``job`` to end; False (the job cancelled) if the client disconnects first."""
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        job.wake = lambda: loop.call_soon_threadsafe(woken.set)
        job.waker = (loop, woken)
        while not job.done.is_set():
            try:
                await asyncio.wait_for(woken.wait(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    front.account(job)
                    return False
            woken.clear()
        return True

    async def completion(request: Request, chat: bool):
        body = await body_of(request)
        c, job = front.submit(body, chat=chat)
        if not c["stream"]:
            if not await wait(request, job):
                return JSONResponse({}, status_code=499)  # nobody reads it
            front.account(job)
            return front.answer(c, job)
        return StreamingResponse(events(job, Streamer(front, c, job)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def events(job, st: Streamer):
        """Server-sent events: ``data: {json}`` per event, then ``data: [DONE]``; a client that goes
        away (the response task is cancelled) cancels the job. The events of every token that
        arrived since the last wake-up go out in one write (under load, fewer and larger writes)."""
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        job.wake = lambda: loop.call_soon_threadsafe(woken.set)
        job.waker = (loop, woken)
        try:
            for ev in st.start():
                yield sse(ev)
            ended = False
            while not ended:
                out = []
                while True:
                    try:
                        item = job.events.popleft()
                    except IndexError:
                        break
                    if item is None:
                        ended = True
                        break
                    out.append(st.token_sse(*item))
                data = b"".join(out)
                if data:
                    yield data
                if not ended:
                    woken.clear()
                    if not job.events:
                        await woken.wait()
            for ev in st.end():
                yield sse(ev)
            yield b"data: [DONE]\n\n"
        finally:
            if not job.done.is_set():
                job.cancelled.set()
            front.account(job)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return front.models()

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        return front.model(model_id)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return front.health()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return PlainTextResponse(front.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return _Guard(app, front, api_key, read_timeout_s)


class ServerThread:
    """uvicorn serving ``app`` on the bound socket ``sock`` in a daemon thread. :meth:`start`
    returns once it accepts connections; :meth:`stop` closes the listener and the idle keep-alive
    connections at once, lets responses being written finish (at most ``grace_s``), and joins."""

    def __init__(self, app, sock: socket.socket, grace_s: float = 30.0):
        import uvicorn

        self.sock = sock
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=grace_s, timeout_keep_alive=60, backlog=256,
                                http=http_protocol(getattr(app, "read_timeout_s", 60.0)))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="zerotron-http")

    def start(self, timeout_s: float = 60.0) -> None:
        self.thread.start()
        for _ in range(int(timeout_s / 0.01)):
            if self.server.started or not self.thread.is_alive():
                break
            self.thread.join(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port; SO_REUSEADDR). Raises
    ValueError (one line naming the address and the fix) when this process cannot listen there
    (a port in use, an address of another machine, a name that does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(infos[0][4])
            sock.listen(256)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        why = e.strerror or str(e)
        raise ValueError(f"cannot listen on {host}:{port} ({why}); choose another --port (0 = any free one) "
                         "or a --host address of this machine") from None
    return sock


def check_listen(host: str, port: int) -> None:
    """Raise ValueError as :func:`bind` does if this process cannot listen on ``host``:``port``
    (binds and closes a socket: the launcher's check before any worker starts)."""
    bind(host, port).close()
