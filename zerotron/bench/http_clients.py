"""The clients of ``zerotron bench serve`` (:mod:`zerotron.bench.serve_http`, figures defined in its
docstring): C concurrent clients, each sending its prompts one after the other as streamed
``/v1/completions`` (the ``openai`` client's ``AsyncOpenAI``, or hand-made requests on asyncio
connections), zerotron's ``/metrics`` polled meanwhile (:func:`run_clients`); the workloads' prompts
(:func:`make_prompts`)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

from zerotron.bench.http_servers import Server, server_metrics
from zerotron.bench.report import percentile


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    usage = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for ch in stream:
            if ch.choices and ch.choices[0].text:
                last = time.perf_counter()
                first = first or last
            if getattr(ch, "usage", None) is not None:
                usage = ch.usage
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "t0": t0, "t1": time.perf_counter()}
    ntok = usage.completion_tokens if usage is not None else 0
    return {"ok": usage is not None and first is not None, "t0": t0, "t1": time.perf_counter(), "ntok": ntok,
            "ttft": None if first is None else first - t0,
            "tpot": (last - first) / (ntok - 1) if first is not None and ntok > 1 else None,
            "error": None if usage is not None else "no usage in the stream"}


_EVENT_END = re.compile(rb"\r?\n\r?\n")  # a server-sent event ends with a blank line (LF or CRLF)


async def _one_raw(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """:func:`_one` over a raw asyncio connection: the request by hand, the chunked body decoded,
    each event's JSON parsed with ``json.loads`` (a fraction of the openai client's CPU per event,
    which on a small machine can bound what the clients read)."""
    t0 = time.perf_counter()
    first = last = ntok = None
    host, port = base.split("//", 1)[1].rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    key = os.environ.get("ZEROTRON_API_KEY", "none")
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        status = (await reader.readline()).split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(status) < 2 or status[1] != b"200":
            raise RuntimeError(f"HTTP {b' '.join(status[1:]).decode()}: {(await reader.read())[:200]!r}")
        chunked, buf, done = headers.get("transfer-encoding") == "chunked", b"", False
        while not done:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                data = await reader.readexactly(size + 2) if size else b""
                data, done = data[:-2], size == 0
            else:
                data = await reader.read(65536)
                done = not data
            *events, buf = _EVENT_END.split(buf + data)
            for ev in events:
                payload = ev.partition(b"data:")[2].strip()
                if not payload or payload == b"[DONE]":
                    continue
                j = json.loads(payload)
                if j.get("choices") and j["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                if j.get("usage"):
                    ntok = j["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "t0": t0, "t1": time.perf_counter()}
    finally:
        if writer is not None:
            writer.close()
    return {"ok": ntok is not None and first is not None, "t0": t0, "t1": time.perf_counter(), "ntok": ntok or 0,
            "ttft": None if first is None else first - t0,
            "tpot": (last - first) / (ntok - 1) if first is not None and ntok and ntok > 1 else None,
            "error": None if ntok is not None else "no usage in the stream"}


async def _clients(base: str, model: str, prompts: list[list[str]], max_tokens: int, poll,
                   client_kind: str = "openai") -> list[dict]:
    client = None
    if client_kind == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=os.environ.get("ZEROTRON_API_KEY", "none"),
                                    max_retries=0, timeout=3600)

    async def worker(mine: list[str]) -> list[dict]:
        if client is None:
            return [await _one_raw(base, model, p, max_tokens) for p in mine]
        return [await _one(client, model, p, max_tokens) for p in mine]

    stop = asyncio.Event()

    async def poller():
        while not stop.is_set():
            await asyncio.to_thread(poll)
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    task = asyncio.create_task(poller()) if poll is not None else None
    try:
        res = await asyncio.gather(*(worker(m) for m in prompts))
    finally:
        stop.set()
        if task is not None:
            await task
        if client is not None:
            await client.close()
    return [r for rs in res for r in rs]


def run_clients(srv: Server, prompts: list[list[str]], max_tokens: int, client: str = "openai") -> dict:
    """Run one client per list of ``prompts`` (each sends its prompts one after the other) against
    ``srv``; the run's figures (see :mod:`zerotron.bench.serve_http`). ``client``: "openai" (``AsyncOpenAI``) or
    "raw" (:func:`_one_raw`)."""
    samples: list[dict] = []
    poll = None
    if srv.name == "zerotron":
        before = server_metrics(srv.base)

        def poll():
            try:
                samples.append(server_metrics(srv.base))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
    res = asyncio.run(_clients(srv.base, srv.model, prompts, max_tokens, poll, client))
    ok = [r for r in res if r["ok"]]
    span = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    toks = sum(r["ntok"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    lat = [r["t1"] - r["t0"] for r in ok]
    row = {"requests": len(res), "completed": len(ok), "failed": len(res) - len(ok),
           "errors": sorted({r["error"] for r in res if not r["ok"]})[:3], "output_tokens": toks, "wall_s": span,
           "output_tokens_per_s": toks / span, "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
           "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99), "latency_p99_s": percentile(lat, 0.99),
           "kv_waste": None, "kv_blocks_peak": None, "preemptions": None}
    if srv.name == "zerotron":
        after = server_metrics(srv.base)
        alloc = sum(s.get("zerotron_kv_slots_allocated", 0) for s in samples)
        filled = sum(s.get("zerotron_kv_slots_filled", 0) for s in samples)
        row.update(kv_waste=1 - filled / alloc if alloc else None, kv_samples=len(samples),
                   kv_blocks_peak=max((s.get("zerotron_kv_blocks_used", 0) for s in samples), default=0),
                   kv_blocks_pool=after.get("zerotron_kv_blocks_used", 0) + after.get("zerotron_kv_blocks_free", 0),
                   preemptions=after.get("zerotron_preemptions_total", 0) - before.get("zerotron_preemptions_total", 0))
    return row


def make_prompts(tokenizer, workload: str, n: int, lo: int, hi: int, shared: int, seed: int) -> list[str]:
    """``n`` prompt texts of ``workload`` from ``tokenizer`` (a ``tokenizers.Tokenizer``), seeded."""
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size()
    special = {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>")}
    draw = lambda k: [t for t in (rng.randrange(vocab) for _ in range(k)) if t not in special]  # noqa: E731
    if workload == "random":
        return [tokenizer.decode(draw(rng.randint(lo, hi))) for _ in range(n)]
    system = tokenizer.decode(draw(shared))
    return [system + tokenizer.decode(draw(16)) for _ in range(n)]
