"""The tables of ``zerotron bench serve`` (:mod:`zerotron.bench.serve_http`): one row per run
(:func:`rows_table`) and the zerotron / transformers paired ratios per round (:func:`ratios`),
summarised by their median and range (:func:`ratio_table`)."""
from __future__ import annotations


def rows_table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (one per server and run)."""
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


def ratio_table(rat: list[dict]) -> str:
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
