"""The HTTP layer of ``zerotron serve`` (rank 0): routes, JSON errors, server-sent events, on the
standard library's ``http.server.ThreadingHTTPServer`` (one thread per connection; a maintained
server, not a hand-written parser: no web framework is a dependency of zerotron).

A handler waiting for its answer checks about every 0.25 s that its client is still connected
(:func:`client_alive`: the socket reads as closed); a client that left, or a write that fails
mid-stream, cancels the job (:class:`~zerotron.serve.api.Front`). A client that half-closes its
side after sending the request (``shutdown(SHUT_WR)``, rare for HTTP clients: curl, urllib, httpx
and the openai package keep it open) reads the same as one that left, and is cancelled."""
from __future__ import annotations

import json
import select
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .api import ClientGone, Front
from .validation import RequestError

__all__ = ["Listener", "make_handler", "check_listen", "client_alive"]


def client_alive(sock: socket.socket) -> bool:
    """False once the peer of ``sock`` has closed or reset the connection (a zero-length peek on a
    readable socket); True while it is open (also when it sent more bytes, e.g. a next request)."""
    try:
        readable = select.select([sock], [], [], 0)[0]
        if not readable:
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except (OSError, ValueError):
        return False


def make_handler(front: Front, max_body_bytes: int, read_timeout_s: float = 60.0):
    """The request handler class serving ``front``: bodies of at most ``max_body_bytes``; a
    connection whose client sends nothing for ``read_timeout_s`` seconds is closed (socket timeout;
    waiting for an answer is not reading, so long generations are not cut)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = read_timeout_s  # a client that stops sending mid-request frees its thread


        def log_message(self, fmt, *a):  # quiet: one line per request would flood the logs
            pass

        def _alive(self) -> bool:
            return client_alive(self.connection)

        def _send(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":  # a HEAD answer has the GET answer's headers, no content
                    self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client left: nothing to answer
                pass

        def _error(self, e: RequestError) -> None:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}})

        def do_GET(self):
            if self.path == "/health":
                self._send(200, front.health())
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": front.model_id, "object": "model",
                                                              "created": 0, "owned_by": "zerotron"}]})
            else:
                self._error(RequestError(f"no route GET {self.path}", status=404))

        def do_POST(self):
            if self.path != "/v1/completions":
                self._error(RequestError(f"no route POST {self.path}", status=404))
                return
            try:
                raw = self._body()
            except TimeoutError:  # the client stopped sending mid-body
                self.close_connection = True
                self._error(RequestError(f"the request body did not arrive within {read_timeout_s:g} s", status=408))
                return
            except RequestError as e:
                self.close_connection = True  # the rest of the body is unread: the connection is spent
                self._error(e)
                return
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                self._error(RequestError(f"the body is not valid JSON: {e}"))
                return
            try:
                if isinstance(body, dict) and body.get("stream") is True:
                    self._stream(*front.stream(body, self._alive))
                else:
                    self._send(200, front.complete(body, self._alive))
            except RequestError as e:
                self._error(e)
            except ClientGone:
                self.close_connection = True

        def _body(self) -> bytes:
            """The request body: ``Content-Length`` bytes, or a ``Transfer-Encoding: chunked`` body
            (HTTP/1.1, RFC 9112 section 7.1) decoded, at most ``max_body_bytes``. RequestError 411
            without either, 413 when too large, 400 for a malformed length or chunk."""
            too_big = RequestError(f"the body must be at most {max_body_bytes} bytes", status=413)
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                out = b""
                while True:
                    line = self.rfile.readline(1024)
                    try:
                        size = int(line.split(b";")[0].strip(), 16)
                    except ValueError:
                        raise RequestError(f"malformed chunk size line {line[:40]!r}") from None
                    if size < 0 or len(out) + size > max_body_bytes:
                        raise too_big
                    if size == 0:
                        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                            pass  # trailer fields
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline(8)  # the CRLF after the chunk's data
            if "Content-Length" not in self.headers:
                raise RequestError("the request needs a Content-Length header (or Transfer-Encoding: chunked)",
                                   status=411)
            try:
                length = int(self.headers["Content-Length"])
            except ValueError:
                raise RequestError(f"Content-Length must be an integer, got {self.headers['Content-Length']!r}"[:200])\
                    from None
            if length < 0 or length > max_body_bytes:
                raise too_big
            return self.rfile.read(length)

        def _not_allowed(self):
            allow = "POST" if self.path == "/v1/completions" else "GET"
            data = json.dumps({"error": {"message": f"method {self.command} is not allowed on {self.path}; "
                                         f"use {allow}", "type": "invalid_request_error", "param": None,
                                         "code": None}}).encode()
            self.send_response(405)
            self.send_header("Allow", allow)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def do_HEAD(self):
            """HEAD of a GET route: its status and headers without the body (RFC 9110 9.3.2); of
            /v1/completions: 405 without a body."""
            if self.path == "/v1/completions":
                self._not_allowed()
            else:
                self.do_GET()

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        def _stream(self, job, events) -> None:
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
                if job.cancelled.is_set():  # the client left while waiting: nothing more to write
                    self.close_connection = True
                    return
                write(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client left: rows cancelled
                job.cancelled.set()
                self.close_connection = True

    return Handler


class Listener(ThreadingHTTPServer):
    """The HTTP server with a listen backlog for bursts of clients (socketserver's default of 5
    resets connections beyond it)."""

    request_queue_size = 256


def check_listen(host: str, port: int) -> None:
    """Raise ValueError (one line naming the address and the fix) if this process cannot listen
    on ``host``:``port`` (a port in use, an address of another machine, a name that does not
    resolve); binds and closes a socket the way ``ThreadingHTTPServer`` does (SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(infos[0][4])
    except OSError as e:
        why = e.strerror or str(e)
        raise ValueError(f"cannot listen on {host}:{port} ({why}); choose another --port (0 = any free one) "
                         "or a --host address of this machine") from None
