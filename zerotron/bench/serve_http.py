"""``zerotron bench serve --checkpoint DIR``: real servers over real HTTP, zerotron vs ``transformers serve``.

Usage: ``zerotron bench serve --checkpoint RUN [--hf DIR] [--concurrency 16,64] [--peer transformers|none]
[--workloads random,shared-prefix] [--max-tokens 256] [--prompt-tokens 16,128] [--shared-prefix 512]
[--requests-per-client 1] [--rounds 1] [--client openai|raw] [--serve-args "..."] [--threads N] [--json F]
[--markdown F]``.

Two servers (``zerotron serve --checkpoint RUN`` continuous batching over its paged KV cache, and
``transformers serve --continuous-batching`` (transformers' paged mode) on the ``zerotron export``
of the same checkpoint, so both hold the same weights), each started as a subprocess with
``--threads`` torch threads; for each workload and concurrency C, on each server: C clients
(one asyncio task each, the official ``openai`` client's ``AsyncOpenAI``, one shared connection
pool; ``--client raw``: hand-made requests on asyncio connections, see :func:`_one_raw`) each
send ``--requests-per-client`` streamed ``/v1/completions`` one after the other, greedy,
``max_tokens`` = ``--max-tokens``; the prompts are the same for both servers (seeded):

* ``random``: random tokens of the export's tokenizer, ``--prompt-tokens MIN,MAX`` long, decoded
  to text;
* ``shared-prefix``: one ``--shared-prefix``-token random system prompt, then 16 tokens per request.

Every (workload, concurrency) run has prompts (and a system prompt) of its own, so no run finds
another's prefixes cached.

Per request: TTFT = first non-empty text chunk - send; TPOT = (last chunk - first chunk) /
(completion tokens - 1); completion tokens from the stream's final ``usage`` (``stream_options
include_usage``). Per run: output_tokens_per_s = all completion tokens / (last answer - first
send); TTFT/TPOT p50 and p99; failed requests (an HTTP error or an exception: counted, not
raised). zerotron only (``/metrics``, polled every 0.25 s while the run lasts): ``kv_waste`` =
1 - sum of ``zerotron_kv_slots_filled`` / sum of ``zerotron_kv_slots_allocated`` over the samples
(slots reserved in blocks in use but holding no token: partial last blocks, blocks reserved ahead
of a chunked prefill), the peak blocks in use, and the preemptions of the run (the pool ran out:
rows freed and recomputed). transformers serve exposes no KV figures: its ``kv_waste`` is null.

``--json`` writes one JSON array of rows (server, workload, concurrency, round and the figures
above); ``--markdown`` a table with the zerotron / transformers ratios. A peer that cannot start is
reported (its error line) and the zerotron rows are still written.

Both servers are started first and stay up; each (workload, concurrency) run goes to one server,
then at once to the other (never both at the same time), the order swapping every run, and
``--rounds R`` repeats the whole sweep with fresh prompts: on a shared machine each ratio is then
*paired* (its two runs saw nearly the same load) and the R paired ratios show the spread; the
markdown gives their median and range. An idle server costs little (zerotron's batcher waits on its
queue); the CPU seconds the waiting server took during the other's run are recorded
(``idle_peer_cpu_s``)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zerotron.out_files import check_out_files, write_out_file

__all__ = ["main", "run_clients", "start_server"]

WORKLOADS = ("random", "shared-prefix")
PEERS = ("transformers", "none")
PEER_ARGS = "--cb-num-blocks 2048 --cb-block-size 16 --cb-max-batch-tokens 2048"


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess: ``base`` (http://host:port), ``model`` (the id to send), ``lines``
    (its output so far); :meth:`stop` ends it (SIGTERM, then SIGKILL after 30 s)."""

    def __init__(self, name: str, cmd: list[str], env: dict, model: str, base: str | None = None):
        self.name, self.model, self.base = name, model, base
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(ln) for ln in self.proc.stdout], daemon=True).start()

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _ready(base: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def start_server(kind: str, checkpoint: str, hf: str, threads: int, max_batch: int, extra: list[str],
                 timeout_s: float = 300) -> Server:
    """Start ``kind`` ("zerotron": ``zerotron serve`` on ``checkpoint``; "transformers":
    ``transformers serve --continuous-batching`` on the export ``hf``, CPU) with ``threads`` torch
    threads and wait until ``/v1/models`` answers. Raises RuntimeError (with the server's last
    output lines) if it exits or is not up within ``timeout_s``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    if kind == "zerotron":
        srv = Server(kind, [sys.executable, "-m", "zerotron", "serve", "--checkpoint", checkpoint, "--port", "0",
                            "--max-batch", str(max_batch), "--model-name", "bench", *extra], env, "bench")
    else:
        port = _free_port()
        code = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
        srv = Server(kind, [sys.executable, "-c", code, "serve", hf, "--continuous-batching", "--device", "cpu",
                            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra], env, hf,
                     f"http://127.0.0.1:{port}")
    deadline = time.time() + timeout_s
    while True:
        if srv.base is None and (m := re.search(r"listening on (http://\S+)", srv.output())):
            srv.base = m.group(1)
        if srv.base is not None and _ready(srv.base):
            return srv
        if srv.proc.poll() is not None or time.time() > deadline:
            srv.stop()
            tail = "\n".join(srv.output().strip().splitlines()[-15:])
            raise RuntimeError(f"{kind} server did not start (exit {srv.proc.returncode}): {tail}")
        time.sleep(0.3)


def _metrics(base: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("zerotron_") and "{" not in ln}


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
    ``srv``; the run's figures (see the module docstring). ``client``: "openai" (``AsyncOpenAI``) or
    "raw" (:func:`_one_raw`)."""
    samples: list[dict] = []
    poll = None
    if srv.name == "zerotron":
        before = _metrics(srv.base)

        def poll():
            try:
                samples.append(_metrics(srv.base))
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
           "output_tokens_per_s": toks / span, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
           "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99), "latency_p99_s": _pct(lat, 0.99),
           "kv_waste": None, "kv_blocks_peak": None, "preemptions": None}
    if srv.name == "zerotron":
        after = _metrics(srv.base)
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


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron bench serve", allow_abbrev=False, formatter_class=HelpFormatter,
                           description="zerotron serve vs transformers serve over HTTP (same weights, same prompts).")
    p.add_argument("--checkpoint", required=True, help="a zerotron run directory (served by zerotron serve)")
    p.add_argument("--hf", default=None, help="its zerotron export (exported there if missing; default: a "
                   "temporary directory)")
    p.add_argument("--concurrency", default="16,64", help="comma list of concurrent clients")
    p.add_argument("--peer", default="transformers", help="transformers (transformers serve --continuous-batching) "
                   "or none")
    p.add_argument("--workloads", default="random,shared-prefix", help="comma list of random, shared-prefix")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--prompt-tokens", default="16,128", help="MIN,MAX tokens of a random prompt")
    p.add_argument("--shared-prefix", type=int, default=512, help="tokens of the shared system prompt")
    p.add_argument("--requests-per-client", type=int, default=1, help="requests each client sends in turn")
    p.add_argument("--serve-args", default="", help="extra options for zerotron serve (one string: --serve-args=\"--kv-page 8\")")
    p.add_argument("--peer-args", default=PEER_ARGS, help="extra options for transformers serve (one string; the "
                   "default gives it zerotron serve's default pool at context 1024: 32 full-context rows of "
                   "16-token blocks, and the same 2048-token step budget; without --cb-num-blocks it sizes its "
                   "cache from memory and, on this CPU machine, its process died at the first request, no error)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per server (0: the CPU count)")
    p.add_argument("--rounds", type=int, default=1, help="sweeps of every (workload, concurrency) run, each on "
                   "both servers back to back (order swapped every run), fresh prompts each round: paired ratios")
    p.add_argument("--client", default="openai", help="openai (the official client's AsyncOpenAI) or raw (asyncio "
                   "connections, events parsed with json.loads: a fraction of the client CPU per token)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--json", help="write the rows here (a JSON array)")
    p.add_argument("--markdown", help="write the table here")
    return p


def _table(rows: list[dict]) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    out = ["| server | workload | clients | done/failed | output tokens/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) "
           "| KV waste | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        waste = "-" if r["kv_waste"] is None else f"{100 * r['kv_waste']:.1f} %"
        out.append(f"| {r['server']} | {r['workload']} | {r['concurrency']} | {r['completed']}/{r['failed']} | "
                   f"{r['output_tokens_per_s']:.0f} | {f(r['ttft_p50_s'])} / {f(r['ttft_p99_s'])} | "
                   f"{f(r['tpot_p50_s'], 4)} / {f(r['tpot_p99_s'], 4)} | "
                   f"{waste} | "
                   f"{'-' if r['preemptions'] is None else int(r['preemptions'])} |")
    return "\n".join(out)


def ratios(rows: list[dict]) -> list[dict]:
    """zerotron / transformers per (workload, concurrency, round): output tokens/s, TTFT p50, TPOT p50."""
    by = {(r["server"], r["workload"], r["concurrency"], r.get("round", 0)): r for r in rows}
    out = []
    for (srv, wl, c, rnd), z in by.items():
        t = by.get(("transformers", wl, c, rnd))
        if srv != "zerotron" or t is None:
            continue
        q = lambda k: None if not z[k] or not t[k] else z[k] / t[k]  # noqa: E731
        out.append({"workload": wl, "concurrency": c, "round": rnd, "output_tokens_per_s": q("output_tokens_per_s"),
                    "ttft_p50_s": q("ttft_p50_s"), "tpot_p50_s": q("tpot_p50_s")})
    return out


def _ratio_table(rat: list[dict]) -> str:
    """Median (and range over rounds) of each paired ratio per (workload, concurrency)."""
    import statistics

    keys = ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s")
    groups: dict = {}
    for r in rat:
        groups.setdefault((r["workload"], r["concurrency"]), []).append(r)

    def cell(rs, k):
        xs = [r[k] for r in rs if r[k] is not None]
        if not xs:
            return "-"
        med = f"{statistics.median(xs):.2f}"
        return med if len(xs) == 1 else f"{med} ({min(xs):.2f}-{max(xs):.2f})"
    out = ["| workload | clients | rounds | output tokens/s | TTFT p50 | TPOT p50 |", "|---|---|---|---|---|---|"]
    for (wl, c), rs in groups.items():
        out.append(f"| {wl} | {c} | {len(rs)} | " + " | ".join(cell(rs, k) for k in keys) + " |")
    return "\n".join(out)


def _cpu_s(pid: int, children: bool = True) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, with ``children`` those of its live
    child processes too (zerotron serve's HTTP front end; 0 for what is unreadable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        f = stat[stat.rindex(")") + 2:].split()
        own = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    if not children:
        return own
    try:
        kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        kids = []
    return own + sum(_cpu_s(k, False) for k in kids)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench serve --checkpoint``; returns an exit code (2 for bad
    arguments, 1 if a zerotron request failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        check_out_files({"--json": args.json, "--markdown": args.markdown})
        conc = [int(x) for x in args.concurrency.split(",")]
        lo, hi = (int(x) for x in args.prompt_tokens.split(","))
        workloads = args.workloads.split(",")
        if min(conc) < 1 or not 1 <= lo <= hi or min(args.max_tokens, args.requests_per_client, args.rounds) < 1:
            raise ValueError("--concurrency, --prompt-tokens MIN<=MAX, --max-tokens, --requests-per-client, --rounds "
                             "must be >= 1")
        if bad := [w for w in workloads if w not in WORKLOADS]:
            raise ValueError(f"--workloads: unknown {bad}, choose from {', '.join(WORKLOADS)}")
        if args.client not in ("openai", "raw"):
            raise ValueError(f"--client must be openai or raw, got {args.client!r}")
        if args.peer not in PEERS:
            raise ValueError(f"--peer must be one of {', '.join(PEERS)}, got {args.peer!r}")
    except SystemExit as e:
        return int(e.code or 0)
    except ValueError as e:
        print(f"zerotron bench serve: error: {e}", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    tmp = tempfile.TemporaryDirectory(prefix="zerotron-bench-serve-")
    hf = args.hf or str(Path(tmp.name) / "hf")
    if not (Path(hf) / "tokenizer.json").exists():
        if subprocess.run([sys.executable, "-m", "zerotron", "export", "--checkpoint", args.checkpoint, "--out",
                           hf]).returncode != 0:
            print("zerotron bench serve: error: zerotron export failed", file=sys.stderr)
            return 1
    tok = Tokenizer.from_file(str(Path(hf) / "tokenizer.json"))
    threads = args.threads or os.cpu_count() or 1
    k = args.requests_per_client  # each (workload, concurrency, round) run has prompts of its own: no run warms
    # another's cache; both servers get the same prompts
    prompts = {(w, c, r): make_prompts(tok, w, c * k, lo, hi, args.shared_prefix,
                                       args.seed + 1000 * i + c + 100_000 * r)
               for i, w in enumerate(workloads) for c in conc for r in range(args.rounds)}
    warm = make_prompts(tok, "random", 1, lo, hi, args.shared_prefix, args.seed - 1)
    rows, notes = [], []
    load0 = os.getloadavg()[0]
    servers = {}
    try:
        for kind in ["zerotron"] + (["transformers"] if args.peer == "transformers" else []):
            extra = shlex.split(args.serve_args if kind == "zerotron" else args.peer_args)
            try:
                servers[kind] = start_server(kind, args.checkpoint, hf, threads, max(conc), extra)
            except RuntimeError as e:
                notes.append(str(e))
                print(f"zerotron bench serve: {e}", file=sys.stderr)
                continue
            run_clients(servers[kind], [warm], 4, args.client)  # warm-up: one short request
        runs = [(r, w, c) for r in range(args.rounds) for w in workloads for c in conc]
        for n, (r, w, c) in enumerate(runs):
            order = list(servers) if n % 2 == 0 else list(servers)[::-1]
            for kind in order:
                srv, others = servers[kind], [s for s in servers.values() if s is not servers[kind]]
                idle0 = sum(_cpu_s(o.proc.pid) for o in others)
                row = run_clients(srv, [prompts[w, c, r][i * k:(i + 1) * k] for i in range(c)], args.max_tokens,
                                  args.client)
                rows.append({"server": kind, "workload": w, "concurrency": c, "round": r, "client": args.client, **row,
                             "idle_peer_cpu_s": sum(_cpu_s(o.proc.pid) for o in others) - idle0 if others else None,
                             "load_avg": os.getloadavg()[0]})
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    tmp.cleanup()
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, {threads} torch thread(s) per server, "
               f"load average {load0:.1f} at start / {os.getloadavg()[0]:.1f} at end")
    rat = ratios(rows)
    text = (f"{machine}; max_tokens {args.max_tokens}, greedy; random prompts {lo}..{hi} tokens, shared prefix "
            f"{args.shared_prefix} tokens + 16; {args.requests_per_client} request(s) per client ({args.client} "
            f"client); {args.rounds} "
            f"round(s); both servers up, each run on one server then the other (order swapped every run)"
            f"\n\n{_table(rows)}\n")
    if rat:
        text += ("\nzerotron / transformers, paired per round (median, range over rounds in brackets):\n\n"
                 f"{_ratio_table(rat)}\n")
    for note in notes:
        text += f"\nnot run: {note}\n"
    print(f"zerotron bench serve: {text}")
    if args.json:
        write_out_file(args.json, json.dumps([{**r, "machine": machine} for r in rows], indent=1))
    if args.markdown:
        write_out_file(args.markdown, f"# zerotron bench serve\n\n`zerotron bench serve {shlex.join(argv)}`\n\n{text}")
    return 0 if all(r["failed"] == 0 for r in rows if r["server"] == "zerotron") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
