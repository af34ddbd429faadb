"""The HTTP layer of ``zerotron serve`` on its own (no ranks, no model): a real ``Listener`` on a
free port with a stand-in front that answers with the validated request, driven by a real client
(``http.client``) and raw sockets for what clients rarely send (chunked bodies, no length,
stalled requests, other methods)."""
import http.client
import json
import socket
import threading
import time

import pytest

from zerotron.serve.http_api import Listener, make_handler
from zerotron.serve.validation import RequestError, parse_completion


class EchoFront:
    """Answers a completion with the parsed request (what the real front hands to the batcher)."""

    model_id = "tiny"

    def health(self):
        return {"status": "ok"}

    def complete(self, body, alive=None):
        return {"parsed": parse_completion(body, self.model_id)}

    def stream(self, body, alive=None):
        raise RequestError("no streaming here")


@pytest.fixture(scope="module")
def server():
    httpd = Listener(("127.0.0.1", 0), make_handler(EchoFront(), max_body_bytes=256, read_timeout_s=0.5))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd.server_address
    httpd.shutdown()
    httpd.server_close()


def _request(addr, method, path, body=None, headers=None):
    c = http.client.HTTPConnection(*addr, timeout=10)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), json.loads(data) if data else None


def _raw(addr, data: bytes) -> bytes:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or len(out) < out.find(b"\r\n\r\n") + 4 + _length(out):
            piece = s.recv(4096)
            if not piece:
                break
            out += piece
        return out


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_fields_are_checked(server):
    ok = {"prompt": "hi", "max_tokens": 2, "user": "u-1", "echo": False, "logprobs": None, "best_of": 1,
          "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "suffix": None}
    code, _, r = _request(server, "POST", "/v1/completions", json.dumps(ok), {"Content-Type": "application/json"})
    assert code == 200 and r["parsed"]["prompts"] == ["hi"] and r["parsed"]["max_tokens"] == 2, r
    for field, value, code_want in (("max_token", 3, "unknown_parameter"), ("echo", True, "unsupported_parameter"),
                                    ("logprobs", 2, "unsupported_parameter"), ("best_of", 3, "unsupported_parameter"),
                                    ("presence_penalty", 0.5, "unsupported_parameter"),
                                    ("logit_bias", {"5": 10}, "unsupported_parameter")):
        code, _, r = _request(server, "POST", "/v1/completions", json.dumps({"prompt": "hi", field: value}))
        assert code == 400 and r["error"]["param"] == field and r["error"]["code"] == code_want, (field, r)
        assert field in r["error"]["message"], r
    code, _, r = _request(server, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_token": 3}))
    assert "valid fields: model, prompt, max_tokens" in r["error"]["message"], r


def test_chunked_body_is_read(server):
    body = json.dumps({"prompt": "chunked", "max_tokens": 1}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    out = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                       b"Connection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    head, _, data = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), out
    assert json.loads(data)["parsed"]["prompts"] == ["chunked"]
    big = b"%x\r\n%s\r\n" % (300, b"x" * 300)  # over max_body_bytes (256) in one chunk
    out = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + big)
    assert out.startswith(b"HTTP/1.1 413"), out
    out = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert out.startswith(b"HTTP/1.1 400") and b"malformed chunk size" in out, out


def test_length_errors(server):
    out = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 411") and b"Content-Length" in out, out
    out = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400") and b"must be an integer" in out, out
    code, _, r = _request(server, "POST", "/v1/completions", json.dumps({"prompt": "x" * 400}))
    assert code == 413 and "at most 256 bytes" in r["error"]["message"], r


def test_other_methods_get_json_405(server):
    for method, path, allow in (("DELETE", "/v1/completions", "POST"), ("PUT", "/health", "GET"),
                                ("PATCH", "/v1/models", "GET")):
        code, headers, r = _request(server, method, path)
        assert code == 405 and headers["Allow"] == allow and method in r["error"]["message"], (method, r)
    assert _request(server, "GET", "/health")[:1] == (200,)  # still serving
    # HEAD: the GET answer's status and headers, no body (raw socket: http.client would not read one)
    for path, status in (("/health", b"200"), ("/v1/completions", b"405"), ("/nope", b"404")):
        out = _raw(server, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 " + status) and b"Content-Length: " in head and body == b"", out


def test_stalled_client_is_dropped(server):
    """A client that sends half a request and stops: after the read timeout it gets 408 and its
    connection closes, and the server answers others meanwhile."""
    with socket.create_connection(server, timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        t0 = time.time()
        assert _request(server, "GET", "/health")[0] == 200
        reply = b""
        while piece := s.recv(4096):  # until the server closes the connection
            reply += piece
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply, reply
        assert time.time() - t0 < 5
