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
pool; ``--client raw``: hand-made requests on asyncio connections, see :func:`zerotron.bench.http_clients._one_raw`) each
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
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from zerotron.bench.http_clients import make_prompts, run_clients
from zerotron.bench.http_servers import start_server
from zerotron.bench.serve_report import ratio_table, ratios, rows_table
from zerotron.out_files import check_out_files, write_out_file

__all__ = ["main"]

WORKLOADS = ("random", "shared-prefix")
PEERS = ("transformers", "none")
PEER_ARGS = "--cb-num-blocks 2048 --cb-block-size 16 --cb-max-batch-tokens 2048"


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
                print(rows_table(rows[-1:]).splitlines()[-1], flush=True)
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
            f"\n\n{rows_table(rows)}\n")
    if rat:
        text += ("\nzerotron / transformers, paired per round (median, range over rounds in brackets):\n\n"
                 f"{ratio_table(rat)}\n")
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
