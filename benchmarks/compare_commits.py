"""Throughput of two checkouts of zerotron side by side: ``bench train`` (or, with ``--bench
generate``, ``bench generate``: output tokens/s per inference layout) rounds alternated between them.

Usage (both trees share one venv; each run imports the tree it is given):

    python benchmarks/compare_commits.py --old /path/to/old/tree --new . \
        --layouts dp,zero3,tp,pp-1f1b --rounds 6 --json benchmarks/redesign_throughput.json

Each round runs ``zerotron bench train --rounds 1`` once per tree (the order swaps every round, so
neither tree always runs first on a warmer machine) and records tokens/s per layout. The result per
layout is the median over rounds of the *paired* ratio new/old (the two runs of one round saw the
same machine load), with the per-round range; a ratio >= 0.95 means the new tree is not slower.
With ``--bench generate`` also the paired ratio of output tokens per CPU second (the tokens over
the CPU seconds of all ranks in the timed call, from the rows' ``wall_s`` and ``cpu_fraction``):
on a shared machine a run's wall time depends on how often its processes waited for a core, its
CPU seconds much less. Writes JSON (``--json``) and a Markdown table next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(tree: str, layouts: str, nproc: int, steps: int, extra: list[str], bench: str = "train") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        cmd = [sys.executable, "-m", "zerotron", "bench", bench, "--nproc", str(nproc), "--layouts", layouts,
               "--rounds", "1", *(["--steps", str(steps)] if bench == "train" else []), "--json", str(out), *extra]
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    key = "tokens_per_s" if bench == "train" else "output_tokens_per_s"
    out = {r["layout"]: r[key] for r in rows if not r.get("skipped")}
    for r in rows:  # output tokens per CPU second of all ranks: tokens/s / the ranks' summed CPU fractions
        if bench == "generate" and not r.get("skipped") and all(c for c in r.get("cpu_fraction") or [None]):
            out[r["layout"] + "@cpu"] = r[key] / sum(r["cpu_fraction"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the reference tree (e.g. a worktree of the previous commit)")
    ap.add_argument("--new", default=".", help="the tree under test (default: .)")
    ap.add_argument("--bench", default="train", choices=("train", "generate"), help="the zerotron bench to run")
    ap.add_argument("--layouts", default=None, help="default: dp,zero3,tp,pp-1f1b (train), "
                    "single,dp,naive-mp,pp,tp (generate)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the per-round values and ratios here")
    args, extra = ap.parse_known_args(argv)
    if args.layouts is None:
        args.layouts = "dp,zero3,tp,pp-1f1b" if args.bench == "train" else "single,dp,naive-mp,pp,tp"
    per = {"old": [], "new": []}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for which in order:
            per[which].append(_run(getattr(args, which), args.layouts, args.nproc, args.steps, extra, args.bench))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{lay} {per['new'][-1][lay] / per['old'][-1][lay]:.3f}" for lay in per["new"][-1]), flush=True)
    rows = []
    for lay in per["new"][0]:
        if lay.endswith("@cpu"):
            continue
        ratios = [n[lay] / o[lay] for n, o in zip(per["new"], per["old"])]
        rows.append({"layout": lay, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "old_tokens_per_s": [o[lay] for o in per["old"]],
                     "new_tokens_per_s": [n[lay] for n in per["new"]]})
        if all(lay + "@cpu" in r for r in per["new"] + per["old"]):
            cpu = [n[lay + "@cpu"] / o[lay + "@cpu"] for n, o in zip(per["new"], per["old"])]
            rows[-1].update(cpu_ratio_median=statistics.median(cpu), cpu_ratio_min=min(cpu), cpu_ratio_max=max(cpu),
                            old_tokens_per_cpu_s=[o[lay + "@cpu"] for o in per["old"]],
                            new_tokens_per_cpu_s=[n[lay + "@cpu"] for n in per["new"]])
    lines = [f"# Throughput, new tree vs old tree ({args.rounds} paired rounds, `bench {args.bench} --nproc {args.nproc}`)",
             "", f"old: `{args.old}`, new: `{args.new}`, extra overrides: `{' '.join(extra) or 'none'}`", "",
             f"| layout | {'output ' * (args.bench == 'generate')}tokens/s old (median) | tokens/s new (median) | paired ratio new/old (median) | range |"
             + " tokens per CPU s, paired ratio (median) | range |" * ("cpu_ratio_median" in rows[0]),
             "|---|---:|---:|---:|---:|" + "---:|---:|" * ("cpu_ratio_median" in rows[0])]
    for row in rows:
        lines.append(f"| {row['layout']} | {statistics.median(row['old_tokens_per_s']):,.0f} | "
                     f"{statistics.median(row['new_tokens_per_s']):,.0f} | {row['ratio_median']:.3f} | "
                     f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f} |"
                     + (f" {row['cpu_ratio_median']:.3f} | {row['cpu_ratio_min']:.2f}-{row['cpu_ratio_max']:.2f} |"
                        if "cpu_ratio_median" in row else ""))
    md = "\n".join(lines) + "\n"
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old, "new": args.new, "rows": rows}, indent=1))
        Path(args.json).with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
