"""Peak RSS per rank and tokens/s of the disk tier (``train.offload = optimizer-disk``) against the same
run without offload: the gpt2 shape (124 M parameters), 2 ranks, native ZeRO-1, fp32.

Each run is ``zerotron train`` in a fresh wrapper process; its peak RSS per rank is the wrapper's
``RUSAGE_CHILDREN`` ``ru_maxrss`` (the largest resident set any single descendant reached: a rank,
the launcher being smaller). tokens/s: median over the steps after the first of metrics.jsonl's
``tokens_per_s``. Runs alternate none / disk for ``--rounds`` rounds (paired ratios per round).
Usage: ``python benchmarks/offload_disk_rss.py [--rounds 2] [--steps 4] [--out benchmarks/offload_disk_rss]``
(writes OUT.json and OUT.md). Memory estimate: ``zerotron.analysis.memory.model_state_bytes``."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = ["--config", "configs/default.toml", "--model.preset", "gpt2", "--model.n_layer", "12", "--model.n_head", "12",
         "--model.n_embd", "768", "--model.vocab_size", "50257", "--model.block_size", "128"]
WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def run(mode: str, steps: int, tmp: Path, i: int, exact: bool = False) -> dict:
    run_dir = tmp / f"{mode}-{i}"
    off = ["--train.offload", "optimizer-disk", "--train.offload_dir", str(tmp / "offload")] if mode == "disk" else []
    argv = [sys.executable, "-m", "zerotron", "train", *SHAPE, "--nproc", "2", "--run-dir", str(run_dir),
            "--parallel.zero_stage", "1", "--train.steps", str(steps), "--train.micro_batch", "1",
            "--train.global_batch", "2", "--train.eval_every", "0", "--checkpoint.every", "0",
            "--checkpoint.save_final", "false", "--log.progress", "false", "--log.plot", "false",
            "--log.sample_tokens", "0", "--log.every", "1", *off]
    (tmp / "offload").mkdir(exist_ok=True)
    # --exact-memory: glibc's mmap threshold fixed at 128 KiB (its MALLOC_MMAP_THRESHOLD_ tunable, as
    # zerotron.bench.train.exact_cpu_memory sets it in-process): every block of 128 KiB or more is its own
    # mapping, returned to the kernel when freed, so the peak RSS follows the live tensors instead of the
    # heap's high-water mark (the same setting for both modes)
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if exact else {})}
    out = subprocess.run([sys.executable, "-c", WRAP, *argv], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps_recs = [r for r in recs if "tokens_per_s" in r]
    tps = statistics.median(r["tokens_per_s"] for r in steps_recs[1:]) if len(steps_recs) > 1 else None
    br = next((r["model_state_breakdown"] for r in reversed(recs) if "model_state_breakdown" in r), None)
    return {"mode": mode, "peak_rss_bytes": peak_kib * 1024, "tokens_per_s": tps, "model_state_breakdown": br}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/offload_disk_rss")
    ap.add_argument("--exact-memory", action="store_true", help="glibc mmap threshold fixed at 128 KiB (both modes)")
    a = ap.parse_args()
    from zerotron.analysis.memory import model_state_bytes

    est = {m: model_state_bytes(124_439_808, 2, 1, "fp32", offload=o) for m, o in (("none", "none"),
                                                                                  ("disk", "optimizer-disk"))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="zt_offload_rss_") as d:
        for i in range(a.rounds):
            for mode in ("none", "disk"):
                rows.append(run(mode, a.steps, Path(d), i, a.exact_memory))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "model_state_breakdown"}), flush=True)
    pairs = [(rows[2 * i], rows[2 * i + 1]) for i in range(a.rounds)]
    res = {"rounds": a.rounds, "steps": a.steps, "exact_memory": a.exact_memory, "rows": rows, "estimate": est,
           "rss_ratio": statistics.median(b["peak_rss_bytes"] / n["peak_rss_bytes"] for n, b in pairs),
           "rss_saved_bytes": statistics.median(n["peak_rss_bytes"] - b["peak_rss_bytes"] for n, b in pairs),
           "estimated_saved_bytes": est["none"]["total_bytes"] - est["disk"]["total_bytes"],
           "tps_ratio": statistics.median(b["tokens_per_s"] / n["tokens_per_s"] for n, b in pairs
                                          if b["tokens_per_s"] and n["tokens_per_s"])}
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    md = ["# Disk tier (`train.offload = optimizer-disk`) vs no offload: gpt2 shape, 2 ranks, ZeRO-1, fp32", "",
          f"`python benchmarks/offload_disk_rss.py --rounds {a.rounds} --steps {a.steps}"
          f"{' --exact-memory' if a.exact_memory else ''}`; block 128, micro-batch 1, "
          "global batch 2. Peak RSS per rank = largest resident set of any rank (ru_maxrss of the children). "
          "The 2-core machine was shared with other jobs: tokens/s are not speed results, only the paired ratio "
          "is indicative.", "",
          "| round | mode | peak RSS per rank (MiB) | tokens/s |", "|---|---|---:|---:|"]
    for i, r in enumerate(rows):
        md.append(f"| {i // 2} | {r['mode']} | {r['peak_rss_bytes'] / 2**20:,.0f} | "
                  f"{r['tokens_per_s'] or float('nan'):.0f} |")
    md += ["", f"Median paired ratio disk ÷ none: peak RSS {res['rss_ratio']:.3f}, tokens/s {res['tps_ratio']:.3f}. "
           f"Saved per rank {res['rss_saved_bytes'] / 1e9:.3f} GB; the estimator's device-state difference "
           f"(Adam moments leave the process) {res['estimated_saved_bytes'] / 1e9:.3f} GB "
           f"(ratio {res['rss_saved_bytes'] / res['estimated_saved_bytes']:.3f})."]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
