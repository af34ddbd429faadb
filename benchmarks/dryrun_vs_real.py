"""Issue 33's small-layout acceptance line: a dry run's peak per rank (fake tensors, fake process
group, MemTracker) against the bytes the CPU allocator held during the same step of a real run
(gloo, real tensors: ``zerotron.bench.step_memory.measure_step_memory``), for every rank of small
layouts that run for real on this machine (2-8 processes, configs/tiny.toml).

    python benchmarks/dryrun_vs_real.py --json benchmarks/dryrun_vs_real.json --md benchmarks/dryrun_vs_real.md

    python benchmarks/dryrun_vs_real.py --summary benchmarks/dryrun_vs_real.json   # the README table

Per rank: live bytes at the step's start, its peak and its end, real and dry, and the difference;
gloo's own staging buffers, kernels' workspaces (bf16 matmuls' oneDNN scratch) and the blocks freed
on gloo worker threads (all in ``bench.step_memory``'s docstring); whether the step's collectives (calls and bytes per op, group
and tag) equal ``comm.STATS`` of the real run.
The real run holds one thing the dry run does not count: the int64 token ids of the rank's
micro-batches (x and y, 16 bytes per token; the dry run makes them as real tensors outside its fake
mode), so "real - dry - ids" is what is left to explain. Minutes of CPU; wall times mean nothing on
a shared machine.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zerotron.testing import run_ranks, tiny_config

BASE = {"train.micro_batch": 2, "train.global_batch": 8, "parallel.backend": "gloo"}  # the dry run traces gloo's paths
BF16 = {"train.dtype": "bf16"}
# (name, world, overrides)
LAYOUTS = [
    ("ddp-dp2", 2, {"parallel.dp": 2}),
    ("zero1-dp2", 2, {"parallel.dp": 2, "parallel.zero_stage": 1}),
    ("zero3-dp2", 2, {"parallel.dp": 2, "parallel.zero_stage": 3}),
    ("fsdp2-dp2", 2, {"parallel.dp": 2, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}),
    ("tp2", 2, {"parallel.tp": 2}),
    ("pp2-1f1b", 2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("zero3-dp2-bf16-full", 2, {"parallel.dp": 2, "parallel.zero_stage": 3, **BF16,
                                "train.activation_checkpointing": "full"}),
    # the three factors of the row above, one pair at a time
    ("zero3-dp2-bf16", 2, {"parallel.dp": 2, "parallel.zero_stage": 3, **BF16}),
    ("zero3-dp2-full", 2, {"parallel.dp": 2, "parallel.zero_stage": 3, "train.activation_checkpointing": "full"}),
    ("ddp-dp2-bf16-full", 2, {"parallel.dp": 2, **BF16, "train.activation_checkpointing": "full"}),
    ("zero1-tp2-pp2-dp2", 8, {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.zero_stage": 1}),
]


def _measure(overrides: dict) -> dict:
    from zerotron.bench.step_memory import measure_step_memory

    return measure_step_memory(tiny_config(overrides))


def compare(name: str, world: int, overrides: dict) -> dict:
    """Real (every rank) and dry (every rank) figures of one layout, side by side."""
    from zerotron.analysis.dryrun import dry_run
    from zerotron.bench.step_memory import traced_comm

    ov = {**BASE, **overrides}
    cfg = tiny_config(ov)
    t0 = time.perf_counter()
    real = run_ranks(_measure, world, ov, join_timeout_s=900)
    t1 = time.perf_counter()
    dry = dry_run(cfg, world, ranks=list(range(world)))
    t2 = time.perf_counter()
    rows = []
    for r, d in zip(real, dry):
        n_micro = cfg.train.global_batch // (d["estimated"]["dp"] * cfg.train.micro_batch)
        ids = 16 * n_micro * cfg.train.micro_batch * cfg.model.block_size  # x and y, int64
        rows.append({"rank": r["rank"], "coords": {k: d["coords"][k] for k in ("pp", "dp", "tp")},
                     "real": {"start": r["held_at_step_start"], "peak": r["peak_bytes_measured"],
                              "end": r["end_of_step"]},
                     "dry": {"start": d["held_at_step_start"], "peak": d["peak_bytes_traced"],
                             "end": d["end_of_step"]["total"]},
                     "estimated": d["peak_bytes_estimated"], "token_id_bytes": ids,
                     "backend_peak": r["backend_peak_bytes"], "unseen_frees": r["unseen_frees"],
                     "workspace_peak": r["workspace_peak_bytes"],
                     "peak_at": d["peak_at"], "states_equal": r["model_state_bytes"] == d["model_state_bytes"],
                     "comm_equal": r["comm"] == traced_comm(d), "comm_calls": sum(v["calls"] for v in r["comm"].values()),
                     "peak_left": r["peak_bytes_measured"] - d["peak_bytes_traced"] - ids,
                     "start_left": r["held_at_step_start"] - d["held_at_step_start"] - ids,
                     "end_left": r["end_of_step"] - d["end_of_step"]["total"] - ids})
    return {"layout": name, "world": world, "overrides": ov, "ranks": rows,
            "wall_s": {"real": round(t1 - t0, 1), "dry": round(t2 - t1, 1)}}


def markdown(results: list[dict]) -> str:
    lines = ["| layout | world | rank (pp, dp, tp) | real peak B | dry peak B | real / dry | real - dry - ids B: "
             "start / peak / end | gloo's own peak B | kernels' workspaces, peak B | unseen frees (n, B) | "
             "collectives equal (calls) | dry / estimated | peak at (dry) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for row in res["ranks"]:
            c, at, u = row["coords"], row["peak_at"] or {}, row["unseen_frees"]
            lines.append(f"| {res['layout']} | {res['world']} | {row['rank']} ({c['pp']}, {c['dp']}, {c['tp']}) | "
                         f"{row['real']['peak']:,} | {row['dry']['peak']:,} | "
                         f"{row['real']['peak'] / row['dry']['peak']:.4f} | "
                         f"{row['start_left']:,} / {row['peak_left']:,} / {row['end_left']:,} | "
                         f"{row['backend_peak']:,} | {row.get('workspace_peak', 0):,} | {u['count']}, {u['bytes']:,} | "
                         f"{'yes' if row['comm_equal'] else 'NO'} ({row['comm_calls']}) | "
                         f"{row['dry']['peak'] / row['estimated']:.3f} | {at.get('phase')} / {at.get('pass')} |")
    return "\n".join(lines) + "\n"


def _span(vals: list, fmt=lambda v: f"{v:,}") -> str:
    lo, hi = min(vals), max(vals)
    return fmt(lo) if lo == hi else f"{fmt(lo)} to {fmt(hi)}"


def summary(results: list[dict]) -> str:
    """One line per layout (ranges over its ranks): the README's table."""
    lines = ["| layout | world | real peak B (rank 0) | real / dry peak | real - dry - ids B: start / peak / end | "
             "gloo's own buffers, peak B | kernels' workspaces, peak B | frees on gloo workers (blocks) | "
             "collectives = comm.STATS |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        rows = res["ranks"]
        left = " / ".join(_span([r[k] for r in rows]) for k in ("start_left", "peak_left", "end_left"))
        lines.append(f"| {res['layout']} | {res['world']} | {rows[0]['real']['peak']:,} | "
                     f"{_span([r['real']['peak'] / r['dry']['peak'] for r in rows], lambda v: f'{v:.4f}')} | {left} | "
                     f"{_span([r['backend_peak'] for r in rows])} | {_span([r.get('workspace_peak', 0) for r in rows])} | "
                     f"{_span([r['unseen_frees']['count'] for r in rows])} | "
                     f"{'yes' if all(r['comm_equal'] for r in rows) else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    ap.add_argument("--summary", type=Path, help="print the README table of this --json output and exit")
    a = ap.parse_args(argv)
    if a.summary:
        print(summary(json.loads(a.summary.read_text())), end="")
        return 0
    only = set(filter(None, a.only.split(",")))
    results = []
    for name, world, ov in LAYOUTS:
        if only and name not in only:
            continue
        results.append(compare(name, world, ov))
        print(markdown(results[-1:]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    if a.md:
        a.md.write_text(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
