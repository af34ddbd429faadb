"""Dropout vs layout: how far a resume into another layout moves the losses when dropout is on.

Dropout masks are drawn per rank coordinate, so a run trains like itself (same-layout resume is
bitwise equal, tests/test_faults.py) but another layout draws other masks. This script trains
configs/tiny.toml for 8 steps on 2 processes (dp 2), then resumes its checkpoint of step 4 in one
process; it reports the largest relative difference of the losses of steps 5-8,
with dropout 0.1 and, as the control, dropout 0 (there the difference is only fp32 reduction order).

Usage: ``python benchmarks/dropout_layout.py [--out benchmarks/dropout_layout_cpu]`` (~1 min on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(run: Path, cache: str, dropout: str, *extra: str) -> None:
    argv = [sys.executable, "-m", "zerotron", "train", "--config", "configs/tiny.toml", "--run-dir", str(run),
            "--model.dropout", dropout, "--checkpoint.every", "4", "--checkpoint.keep", "0", "--train.eval_every", "0",
            "--data.cache_dir", cache, "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false",
            *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])


def losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "dropout_layout_cpu"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="zerotron_dropout_"))
    rows = []
    print("training ...", file=sys.stderr)
    for dropout in ("0.1", "0.0"):
        ref, moved = tmp / f"ref_{dropout}", tmp / f"moved_{dropout}"
        train(ref, str(tmp / "cache"), dropout, "--nproc", "2", "--train.steps", "8")
        shutil.copytree(ref, moved)  # the dp-2 run as if it had died after the checkpoint of step 4
        shutil.rmtree(moved / "checkpoints" / "step_8")
        train(moved, str(tmp / "cache"), dropout, "--train.steps", "8", "--resume")  # one process from step_4
        a_, b_ = losses(ref), losses(moved)
        assert a_[:4] == b_[:4]  # the same run up to the checkpoint (resume keeps those lines)
        rel = max(abs(x - y) / abs(x) for x, y in zip(a_[4:], b_[4:]))
        rows.append({"dropout": float(dropout), "max_rel_loss_diff_steps_5_8": rel,
                     "losses_dp2": a_[4:], "losses_resumed_1proc": b_[4:]})
    Path(a.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    md = ("# Dropout vs layout: dp 2 to step 4, resumed by one process to step 8\n\n"
          "`python benchmarks/dropout_layout.py`, configs/tiny.toml.\n\n| dropout | max relative loss difference, "
          "steps 5-8 |\n|---|---|\n" + "".join(f"| {r['dropout']} | {r['max_rel_loss_diff_steps_5_8']:.1e} |\n"
                                              for r in rows))
    Path(a.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
