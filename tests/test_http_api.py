"""The HTTP layer of ``zerotron serve`` without ranks or a model: the real FastAPI app on a real
uvicorn server (a free port, in a thread), the real :class:`~zerotron.serve.api.Front` with a
byte-level tokenizer (one token per UTF-8 byte, so multi-byte characters split across tokens and
stream chunks), and a scripted batcher in place of the engine (each row emits the bytes of
:data:`SCRIPT` from an offset set by its prompt and seed, ending at max_tokens or a stop string,
as the engine does). Driven by raw clients (``http.client`` on one keep-alive connection, raw
sockets) and the official ``openai`` client. One server for the module."""
import http.client
import json
import socket
import threading
import time

import pytest

from zerotron.serve.api import Front
from zerotron.serve.chat import ChatTemplate
from zerotron.serve.http_api import ServerThread, bind, make_app
from zerotron.serve.streaming import cut_at_stop

KEY = "sk-test-123"
SCRIPT = "Grüße, wörld ✓ — 日本語 ok. "


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class ScriptedBatcher:
    """Stands in for the engine: answers every job's rows from SCRIPT (see the module docstring)."""

    def __init__(self, front, tok):
        self.front, self.tok, self.script = front, tok, tok.encode(SCRIPT).ids
        self.stop = threading.Event()

    def row(self, job, k):
        r = job.requests[k]
        sp = r.params
        off = (sum(r.prompt) + (sp.seed if sp.temperature > 0 else 0)) % len(self.script)
        out = []
        while len(out) < sp.max_tokens:
            out.append(self.script[(off + len(out)) % len(self.script)])
            job.token(k, out[-1])
            if cut_at_stop(self.tok.decode(out), list(sp.stop))[1]:
                break
        return out

    def run(self):
        while not self.stop.is_set():
            try:
                job = self.front.jobs.get(timeout=0.05)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            for k in range(len(job.requests)):
                job.result[k] = self.row(job, k)
            job.finish()


@pytest.fixture(scope="module")
def server():
    tok = byte_tokenizer()
    front = Front(tok, tok.token_to_id("<|endoftext|>"), "tiny", "continuous", chat=ChatTemplate(None))
    sock = bind("127.0.0.1", 0)
    srv = ServerThread(make_app(front, max_body_bytes=2048, api_key=KEY, read_timeout_s=0.5), sock)
    srv.start()
    batcher = ScriptedBatcher(front, tok)
    t = threading.Thread(target=batcher.run, daemon=True)
    t.start()
    yield sock.getsockname()[:2], front, tok
    batcher.stop.set()
    srv.stop()


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _ask(conn, method, path, body=None, headers=AUTH):
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    raw = r.read()
    return r.status, dict(r.getheaders()), raw


def _raw(addr, data: bytes) -> bytes:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(data)
        out = b""
        while piece := s.recv(4096):
            out += piece
        return out


def test_keep_alive_survives_errors(server):
    """Bugs 1 and 2 of issue 31: after a 404, 405 or 400 the same connection serves the next
    request; GET /v1/completions is 405 (with Allow), unknown paths 404, all JSON in OpenAI's shape."""
    addr, _, _ = server
    conn = http.client.HTTPConnection(*addr, timeout=10)
    ok = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    steps = [("GET", "/nowhere", None, 404, None), ("POST", "/v1/completions", ok, 200, None),
             ("GET", "/v1/completions", None, 405, "POST"), ("POST", "/v1/completions", ok, 200, None),
             ("DELETE", "/health", None, 405, "GET, HEAD"), ("GET", "/health", None, 200, None),
             ("POST", "/v1/completions", b"{not json", 400, None), ("GET", "/v1/models", None, 200, None),
             ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, None),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              200, None),
             ("PUT", "/v1/chat/completions", None, 405, "POST"), ("POST", "/v1/completions", ok, 200, None)]
    sock = None
    for method, path, body, want, allow in steps:
        code, headers, raw = _ask(conn, method, path, body)
        assert code == want, (method, path, code, raw)
        assert headers["content-type"].startswith("application/json"), headers
        r = json.loads(raw)
        if code >= 400:
            assert set(r["error"]) == {"message", "type", "param", "code"} and r["error"]["message"], r
        if allow:
            assert set(headers["allow"].split(", ")) == set(allow.split(", ")) and method in r["error"]["message"], r
        sock = sock or conn.sock
        assert conn.sock is sock, (method, path)  # one connection throughout: never closed by the server
    conn.close()
    for path, status in (("/health", b"200"), ("/v1/completions", b"405"), ("/nope", b"404")):
        out = _raw(addr, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         "Connection: close\r\n\r\n".encode())
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 " + status) and body == b"", out


def test_fields_are_checked(server):
    addr, _, _ = server
    conn = http.client.HTTPConnection(*addr, timeout=10)
    ok = {"prompt": "hi", "max_tokens": 2, "user": "u-1", "echo": False, "logprobs": None, "best_of": 1,
          "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "suffix": None,
          "stream_options": None}  # null: the spec's default, allowed without stream
    assert _ask(conn, "POST", "/v1/completions", ok)[0] == 200
    bad = [({"max_tokens": 3}, 400, "prompt", None), ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
           ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens", None),
           ({"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
           ({"prompt": "x", "temperature": "hot"}, 400, "temperature", None), ({"prompt": 5}, 400, "prompt", None),
           ({"prompt": []}, 400, "prompt", None), ({"prompt": ""}, 400, "prompt", None),
           ({"prompt": "x", "top_p": 0}, 400, "top_p", None), ({"prompt": "x", "n": 17}, 400, "n", None),
           ({"prompt": "x", "model": "gpt-9"}, 404, "model", "model_not_found"),
           ({"prompt": "x", "stream": "yes"}, 400, "stream", None),
           # OpenAI's API: "The 'stream_options' parameter is only allowed when 'stream' is enabled." (400)
           ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
           ({"prompt": "x", "stream": False, "stream_options": {}}, 400, "stream_options", None),
           ({"prompt": "\ud800", "max_tokens": 2}, 400, "prompt", None),
           ({"prompt": "x", "stop": "\udfff"}, 400, "stop", None), ({"prompt": "x", "stop": ["a"] * 5}, 400, "stop", None),
           ({"prompt": "x", "seed": 10**23}, 400, "seed", None), ({"prompt": "x", "seed": -1}, 400, "seed", None),
           ({"prompt": "x", "max_token": 3}, 400, "max_token", "unknown_parameter"),
           ({"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
           ({"prompt": "x", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
           ({"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
           ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
           ({"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter")]
    for body, want, param, code_want in bad:
        code, _, raw = _ask(conn, "POST", "/v1/completions", body)
        r = json.loads(raw)["error"]
        assert code == want and r["param"] == param and r["code"] == code_want, (body, code, r)
        assert param in r["message"] or want == 404, r
    code, _, raw = _ask(conn, "POST", "/v1/completions", {"prompt": "hi", "max_token": 3})
    assert "valid fields: model, max_tokens" in json.loads(raw)["error"]["message"], raw
    # no seed: a fresh one per request (sampled requests differ, as in OpenAI's API); a given seed is kept
    _, front, _ = server
    seeds = [front.submit({"prompt": "hi", "max_tokens": 1, **extra})[1].requests[0].params.seed
             for extra in ({}, {}, {"seed": 7}, {"seed": 7})]
    assert seeds[0] != seeds[1] and seeds[2] == seeds[3] == 7, seeds
    chat_bad = [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
                ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
                ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4},
                 "max_tokens"), ({"prompt": "x"}, "messages"),
                ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": False}},
                 "stream_options")]
    for body, param in chat_bad:
        code, _, raw = _ask(conn, "POST", "/v1/chat/completions", body)
        assert code == 400 and json.loads(raw)["error"]["param"] == param, (body, raw)
    # body size: 413 (and the connection closes: its body is unread); a stalled body: 408
    code, headers, raw = _ask(conn, "POST", "/v1/completions", {"prompt": "x" * 3000})
    assert code == 413 and "at most 2048 bytes" in json.loads(raw)["error"]["message"], raw
    conn.close()
    body = json.dumps({"prompt": "chunked", "max_tokens": 1}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    out = _raw(addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
               b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200"), out
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: 100\r\n\r\n{\"pro")
        t0, reply = time.time(), b""
        while piece := s.recv(4096):
            reply += piece
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply, reply
        assert time.time() - t0 < 5



def test_request_head_that_stalls_gets_408(server):
    """slowloris: a request head (request line and headers) that stops arriving -- on a new
    connection, or after an answer on a keep-alive one (also pipelined behind it) -- gets a JSON
    408 after read_timeout_s and the connection closes; a new connection that sends nothing is
    closed. Before, uvicorn held such connections (and their file descriptors) for ever."""
    addr, _, _ = server
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    for first in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth):
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(first + b"\r\n" * bool(first.endswith(auth)) + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            t0, reply = time.time(), b""
            while piece := s.recv(4096):
                reply += piece
        assert time.time() - t0 < 5, reply
        last = reply[reply.rindex(b"HTTP/1.1 "):]
        assert reply.count(b"HTTP/1.1 ") == 1 + bool(first) and last.startswith(b"HTTP/1.1 408"), reply
        err = json.loads(last.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "request_timeout" and "within 0.5 s" in err["message"], err
    with socket.create_connection(addr, timeout=10) as s:  # sends nothing: closed without an answer
        assert s.recv(100) == b""
    conn = http.client.HTTPConnection(*addr, timeout=10)  # a keep-alive connection idle past it stays open
    assert _ask(conn, "GET", "/health")[0] == 200
    time.sleep(1.0)
    assert _ask(conn, "GET", "/health")[0] == 200
    conn.close()


def test_unparsable_http_is_a_json_400(server):
    """A request uvicorn's HTTP parser refuses before the app sees it (Content-Length -1, a header
    line without a colon, a bad request line) gets a 400 in OpenAI's JSON shape, not uvicorn's plain
    text, and the connection closes; the server goes on."""
    addr, _, _ = server
    for bad in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
                b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                b"GET /health\x01 HTTP/1.1\r\nHost: x\r\n\r\n"):
        out = _raw(addr, bad)  # returns once the server closed the connection
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), out
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error", err
        assert "Content-Length" in err["message"] and "well-formed" in err["message"], err
    conn = http.client.HTTPConnection(*addr, timeout=10)
    assert _ask(conn, "GET", "/health")[0] == 200
    conn.close()


def test_client_leaving_mid_body_logs_no_traceback(server):
    """A client that closes its connection before its body has arrived gets nothing (499, counted in
    /metrics) and leaves no "Exception in ASGI application" traceback in the server's log (before:
    starlette's ClientDisconnect escaped the app); the server goes on."""
    import logging

    addr, _, _ = server
    seen: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prom")
        conn = http.client.HTTPConnection(*addr, timeout=10)
        for _ in range(100):  # the disconnect reaches the app asynchronously
            code, _, raw = _ask(conn, "GET", "/metrics")
            if b'code="499"' in raw:
                break
            time.sleep(0.05)
        assert code == 200 and b'zerotron_requests_total{endpoint="/v1/completions",code="499"}' in raw, raw
    finally:
        log.removeHandler(handler)
    assert not seen, [r.getMessage() for r in seen]
    conn.close()


def test_json_the_parser_refuses_is_a_400(server):
    """JSON that Python's parser refuses with other errors than JSONDecodeError -- arrays nested past
    the recursion limit (RecursionError), an integer of more than 4300 digits (ValueError) -- is a
    400 in OpenAI's shape on a connection that stays open, not a 500 (plain-text Internal Server Error)."""
    addr, front, _ = server
    srv = ServerThread(make_app(front, max_body_bytes=10_000, api_key=KEY), bind("127.0.0.1", 0))
    srv.start()
    try:
        conn = http.client.HTTPConnection(*srv.sock.getsockname()[:2], timeout=10)
        for body, why in ((b"[" * 3000 + b"]" * 3000, "RecursionError"), (b"[" * 4000, "RecursionError"),
                          (b'{"prompt": "x", "n": ' + b"7" * 5000 + b"}", "4300 digits")):
            code, headers, raw = _ask(conn, "POST", "/v1/completions", body)
            assert code == 400 and headers["content-type"].startswith("application/json"), (code, raw[:200])
            err = json.loads(raw)["error"]
            assert why in err["message"] and err["type"] == "invalid_request_error", err
        assert _ask(conn, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200  # same connection
        conn.close()
    finally:
        srv.stop()

def test_api_key(server):
    """Every endpoint but /health needs the key: none or a wrong one is 401 JSON."""
    addr, _, _ = server
    conn = http.client.HTTPConnection(*addr, timeout=10)
    for path in ("/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            method = "GET" if path in ("/v1/models", "/metrics") else "POST"
            code, h, raw = _ask(conn, method, path, {"prompt": "x"} if method == "POST" else None, headers)
            assert code == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", (path, headers, raw)
    assert _ask(conn, "GET", "/health", headers={})[0] == 200
    assert _ask(conn, "GET", "/v1/models")[0] == 200  # same connection, with the key


def _sse(raw: bytes) -> list:
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            events.append(block[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_token_id_prompts(server):
    """``prompt`` as token ids, as OpenAI's API takes it (a list of ints: one prompt; a list of such
    lists: several), answers exactly as the same prompts given as text; an id outside the model's
    vocabulary, a negative one, a bool, an empty id list or a mix of ids and text gets one 400
    naming ``prompt``."""
    addr, front, tok = server
    conn = http.client.HTTPConnection(*addr, timeout=10)
    ids = {p: tok.encode(p).ids for p in ("hi", "ab")}
    ask = {"max_tokens": 6, "temperature": 0}
    as_text = json.loads(_ask(conn, "POST", "/v1/completions", {**ask, "prompt": ["hi", "ab"]})[2])
    code, _, raw = _ask(conn, "POST", "/v1/completions", {**ask, "prompt": [ids["hi"], ids["ab"]]})
    assert code == 200, raw
    r = json.loads(raw)
    assert [c["text"] for c in r["choices"]] == [c["text"] for c in as_text["choices"]]
    assert r["usage"] == as_text["usage"]
    code, _, raw = _ask(conn, "POST", "/v1/completions", {**ask, "prompt": ids["hi"]})
    assert code == 200 and json.loads(raw)["choices"][0]["text"] == as_text["choices"][0]["text"], raw
    vocab = tok.get_vocab_size()
    for prompt, words in (([1, vocab], f"token id {vocab}, outside the model's vocabulary of {vocab}"),
                          ([[1], [vocab + 5]], "prompt 1 has token id"), ([-1], "greater than or equal to 0"),
                          ([True], "'prompt.0'"), ([[]], "'prompt.0': List should have at least 1 item"),
                          ([[1], [2, "a"]], "'prompt.1.1': Input should be a valid integer"),
                          ([1, "a"], "'prompt.1': Input should be a valid integer, got 'a'")):
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ask, "prompt": prompt})
        err = json.loads(raw)["error"]
        assert code == 400 and err["param"] == "prompt" and words in err["message"], (prompt, raw)
    conn.close()


def test_openai_client_matches_raw_client(server):
    """The official openai client and a raw client get the same completions, chat completions and
    streamed text (multi-byte characters split across tokens arrive whole); usage, n, stop and seed
    as OpenAI documents them."""
    openai = pytest.importorskip("openai")
    addr, front, tok = server
    client = openai.OpenAI(base_url=f"http://{addr[0]}:{addr[1]}/v1", api_key=KEY, max_retries=0)
    conn = http.client.HTTPConnection(*addr, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{addr[0]}:{addr[1]}/v1", api_key="nope", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")

    body = {"model": "tiny", "prompt": ["ab", "c"], "max_tokens": 12, "temperature": 0, "n": 2}
    r = client.completions.create(**body)
    raw = json.loads(_ask(conn, "POST", "/v1/completions", body)[2])
    assert [c.text for c in r.choices] == [c["text"] for c in raw["choices"]] and len(r.choices) == 4
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(["ab", "c"]):  # the scripted rows: what the tokens decode to
        assert r.choices[2 * i].text == tok.decode([tok.encode(SCRIPT).ids[(sum(tok.encode(p).ids) + j)
                                                                            % len(tok.encode(SCRIPT).ids)]
                                                    for j in range(12)])
    assert r.usage.prompt_tokens == 2 + 1 and r.usage.completion_tokens == 4 * 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert all(c.finish_reason == "length" for c in r.choices)
    assert any(ord(ch) > 127 for c in r.choices for ch in c.text)  # multi-byte text came through

    # stop: cut before the stop string, finish_reason "stop", fewer tokens
    r = client.completions.create(model="tiny", prompt="ab", max_tokens=30, temperature=0, stop=["✓", "日"])
    full = client.completions.create(model="tiny", prompt="ab", max_tokens=30, temperature=0).choices[0].text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == cut_at_stop(full, ["✓", "日"])[0]
    assert r.usage.completion_tokens < 30
    # seed: the same seed gives the same sampled text, another seed another
    s = [client.completions.create(model="tiny", prompt="ab", max_tokens=8, temperature=1.0, seed=k).choices[0].text
         for k in (7, 7, 8)]
    assert s[0] == s[1] != s[2]

    # streaming: pieces concatenate to the plain text; no piece carries a broken character
    for stops in ([], ["wör"]):
        want = client.completions.create(model="tiny", prompt="ab", max_tokens=30, temperature=0, stop=stops or None)
        pieces = [ch.choices[0].text for ch in client.completions.create(
            model="tiny", prompt="ab", max_tokens=30, temperature=0, stop=stops or None, stream=True)]
        code, headers, rawb = _ask(conn, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 30, "temperature": 0,
                                                                     "stream": True, **({"stop": stops} if stops else {})})
        assert code == 200 and headers["content-type"].startswith("text/event-stream")
        raw_pieces = [e["choices"][0]["text"] for e in _sse(rawb)]
        assert "".join(pieces) == "".join(raw_pieces) == want.choices[0].text
        assert len([p for p in pieces if p]) > 3 and all("\ufffd" not in p for p in pieces), pieces
    chunks = list(client.completions.create(model="tiny", prompt="ab", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []

    # chat: the default template renders the messages; same answer both ways, streamed too
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    prompt = "System: Be brief.\n\nUser: Hi ✓\n\nAssistant:"
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    raw = json.loads(_ask(conn, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 10,
                                                                  "temperature": 0})[2])
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == raw["choices"][0]["message"]["content"] == plain.choices[0].text
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tok.encode(prompt).ids) and r.choices[0].finish_reason == "length"
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == plain.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0.8, n=3, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, logprobs=True)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # completions' logprobs too: refused, the field named
        client.completions.create(model="tiny", prompt="x", logprobs=2)
    assert e.value.body["param"] == "logprobs" and e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")


def test_max_tokens_fit_the_context(server):
    """prompt + max_tokens must fit the model's context (OpenAI's and vLLM's rule): a given
    max_tokens (or max_completion_tokens) that does not fit gets 400 naming it with the largest
    value that fits; without one the default is clamped to the room left and the answer ends with
    finish_reason "length"; a prompt longer than the context: 400 naming the prompt."""
    addr, front, tok = server
    conn = http.client.HTTPConnection(*addr, timeout=10)
    front.context = 12  # the byte tokenizer: "hello" is 5 tokens, so 7 new tokens fit
    try:
        ok = {"prompt": "hello", "temperature": 0}
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ok, "max_tokens": 8})
        err = json.loads(raw)["error"]
        assert code == 400 and err["param"] == "max_tokens" and err["code"] == "context_length_exceeded", raw
        assert "at most 7 new tokens" in err["message"] and "12 tokens" in err["message"], err
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ok, "max_tokens": 7})
        r = json.loads(raw)
        assert code == 200 and r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
        code, _, raw = _ask(conn, "POST", "/v1/completions", ok)  # OpenAI's default of 16, clamped to 7
        r = json.loads(raw)
        assert code == 200 and r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ok, "prompt": ["hi", "hello"], "max_tokens": 9})
        assert code == 400 and "prompt 1 has 5 tokens" in json.loads(raw)["error"]["message"], raw  # each prompt
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ok, "prompt": "x" * 12})  # fills it: 0 new
        r = json.loads(raw)
        assert code == 200 and r["choices"][0]["text"] == "" and r["choices"][0]["finish_reason"] == "length", raw
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ok, "prompt": "x" * 13})
        assert code == 400 and json.loads(raw)["error"]["param"] == "prompt", raw
        chat = {"messages": [{"role": "user", "content": "hi"}]}  # the template makes it longer than 12 tokens
        front.context = len(tok.encode(front.chat.render([{"role": "user", "content": "hi"}])).ids) + 3
        code, _, raw = _ask(conn, "POST", "/v1/chat/completions", {**chat, "max_completion_tokens": 4})
        err = json.loads(raw)["error"]
        assert code == 400 and err["param"] == "max_completion_tokens" and "at most 3 new" in err["message"], raw
        code, _, raw = _ask(conn, "POST", "/v1/chat/completions", chat)  # default 256 clamped to 3
        r = json.loads(raw)
        assert code == 200 and r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
        # a long context: max_tokens is bounded by it alone (was also by a fixed 4096 in the schema)
        from zerotron.serve.api import max_new_tokens
        from zerotron.serve.schemas import CompletionRequest, validate

        assert validate(CompletionRequest, {"prompt": "x", "max_tokens": 5000}).max_tokens == 5000
        assert max_new_tokens(5, 5000, 16, 8192) == 5000
        front.context = 8192
        code, _, raw = _ask(conn, "POST", "/v1/completions", {**ok, "max_tokens": 8188})
        assert code == 400 and "at most 8187 new tokens" in json.loads(raw)["error"]["message"], raw
    finally:
        front.context = None


def test_metrics(server):
    addr, _, _ = server
    conn = http.client.HTTPConnection(*addr, timeout=10)
    assert _ask(conn, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 4})[0] == 200
    code, headers, raw = _ask(conn, "GET", "/metrics")
    text = raw.decode()
    assert code == 200 and headers["content-type"].startswith("text/plain; version=0.0.4"), headers
    names = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")}
    assert names == {"zerotron_requests_total", "zerotron_queue_depth", "zerotron_running_rows",
                     "zerotron_generated_tokens_total", "zerotron_cancelled_rows_total",
                     "zerotron_time_to_first_token_seconds", "zerotron_time_per_output_token_seconds",
                     "zerotron_kv_blocks_used", "zerotron_kv_blocks_free", "zerotron_kv_slots_allocated",
                     "zerotron_kv_slots_filled", "zerotron_prefix_cache_hits_total",
                     "zerotron_prefix_cache_misses_total", "zerotron_preemptions_total",
                     "zerotron_spec_proposed_tokens_total", "zerotron_spec_accepted_tokens_total",
                     "zerotron_spec_acceptance_rate"}, names
    samples = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln and not ln.startswith("#")}
    assert samples['zerotron_requests_total{endpoint="/v1/completions",code="200"}'] >= 1
    assert samples["zerotron_generated_tokens_total"] >= 4 and samples["zerotron_queue_depth"] == 0
    n = samples["zerotron_time_to_first_token_seconds_count"]
    assert n >= 1 and samples['zerotron_time_to_first_token_seconds_bucket{le="+Inf"}'] == n
    buckets = [v for k, v in samples.items() if k.startswith("zerotron_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative


def test_chat_template_from_tokenizer_config(tmp_path):
    """A checkpoint's tokenizer_config.json chat_template (a string, or named templates) is used;
    without one, the documented default; a bad file is one ValueError line."""
    from zerotron.serve.chat import DEFAULT_TEMPLATE, load_chat_template

    msgs = [{"role": "user", "content": "Hi"}]
    assert load_chat_template(tmp_path) is None and ChatTemplate(None).source == DEFAULT_TEMPLATE
    tpl = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}" \
          "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    assert ChatTemplate(load_chat_template(tmp_path), eos="</s>").render(msgs) == "<|user|>Hi</s><|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": tpl}]}))
    assert load_chat_template(tmp_path) == tpl
    with pytest.raises(ValueError, match="the chat template failed: no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render(msgs)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_chat_template(tmp_path)


def test_union_field_errors_name_the_field_not_pydantic_internals():
    """prompt / stop (a string or a list of strings): the 400 message names the field path a client
    wrote and the member its input was meant for (before: "'prompt.constrained-str': Input should be
    a valid string, got []" for an empty list)."""
    from zerotron.serve.errors import RequestError
    from zerotron.serve.schemas import CompletionRequest, validate

    for body, words in (({"prompt": []}, "'prompt': List should have at least 1 item"),
                        ({"prompt": ["a", 3]}, "'prompt.1': Input should be a valid string, got 3"),
                        ({"prompt": ""}, "'prompt': String should have at least 1 character"),
                        ({"prompt": 5}, "'prompt': Input should be a valid string, got 5"),
                        ({"prompt": "a", "stop": [""]}, "'stop.0': String should have at least 1 character")):
        with pytest.raises(RequestError) as e:
            validate(CompletionRequest, body)
        msg = str(e.value)
        assert words in msg and "constrained" not in msg and e.value.param == next(iter(body.keys() - {"prompt"}), "prompt"), msg
    # a missing field inside a list names its path (was "'messages' is required" for a message without content)
    from zerotron.serve.schemas import ChatRequest

    for model, body, words in ((ChatRequest, {"messages": [{"role": "user"}]}, "'messages.0.content' is required"),
                               (CompletionRequest, {"max_tokens": 2}, "'prompt' is required")):
        with pytest.raises(RequestError) as e:
            validate(model, body)
        assert str(e.value) == words and e.value.param == words.split("'")[1].split(".")[0], str(e.value)


def test_streamed_event_bytes_equal_the_models():
    """The streaming fast path (a chunk template per choice, pieces spliced in as JSON strings,
    tokenizers' incremental decoder) gives byte for byte the events of the pydantic models over
    the full decode, for completions and chat, with and without stop strings, multi-byte
    characters split across tokens."""
    from zerotron.serve.api import Job, Streamer, sse
    from zerotron.serve.streaming import StreamText

    tok = byte_tokenizer()
    front = Front(tok, tok.token_to_id("<|endoftext|>"), "tiny", "continuous", chat=ChatTemplate(None))
    ids = tok.encode(SCRIPT * 2).ids
    for chat in (False, True):
        for stops in ([], ["wör", "本語 o"]):
            c = {"chat": chat, "stop": stops, "include_usage": False}
            job = Job([None, None], stream=True)
            fast, ref = Streamer(front, c, job), Streamer(front, c, job)
            ref.head = fast.head
            ref.texts = [StreamText(tok.decode, stops) for _ in range(2)]  # decodes every token so far
            assert all(t.step is not None for t in fast.texts)
            got = want = b""
            for i, t in enumerate(ids):
                for k in (0, 1):  # two choices, interleaved as a batcher reports them
                    a, b = fast.token_sse(k, t), b"".join(sse(ev) for ev in ref.token(k, t))
                    assert a == b, (chat, stops, i, a, b)
                    got, want = got + a, want + b
            evs = [e for e in _sse(got + b"data: [DONE]\n\n") if e["choices"][0]["index"] == 1]
            text = "".join(e["choices"][0]["delta"].get("content", "") if chat else e["choices"][0]["text"]
                           for e in evs)
            assert len(evs) >= 5 and (stops or "日本語" in text), (evs, text)
