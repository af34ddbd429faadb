"""Per-file wall and CPU seconds of the test suite, one pytest process per file, optionally paired.

``python benchmarks/suite_time.py --out DIR [--tree LABEL=PATH ...] tests/test_a.py tests/test_b.py``
runs, for each file and then for each tree in turn (so the arms of a pair run back to back),
``python -m pytest -o addopts= -q -p no:cacheprovider -p pytest_cputime FILE`` in that tree (its own
``PYTHONPATH``), under ``nice -n 10``. This process makes itself a child subreaper, so every process
of the tree (orphans too) is reaped here and counted: per file it records the wall seconds and the
user + system CPU seconds of everything the run started (``RUSAGE_CHILDREN`` before/after), the
exit code and pytest's last line, the 1-minute load average at start and end, and the per-test
figures of :mod:`pytest_cputime` (``DIR/LABEL.jsonl``). Results: ``DIR/files.jsonl``. On a loaded
machine only the CPU seconds and the pairs mean much; say the load when quoting them."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PR_SET_CHILD_SUBREAPER = 36


def reap_all() -> None:
    """Wait for every child left (orphans re-parented to this subreaper included)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_file(label: str, tree: Path, file: str, out: Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}", "ZEROTRON_CPUTIME_OUT": str(out / f"{label}.jsonl"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
           "-p", "pytest_cputime", file, *extra]
    load0, c0, t0 = os.getloadavg()[0], cpu_children(), time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    reap_all()
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    rec = {"tree": label, "file": file, "wall_s": round(wall, 2), "cpu_s": round(cpu_children() - c0, 2),
           "rc": p.returncode, "result": tail, "load_start": round(load0, 1), "load_end": round(os.getloadavg()[0], 1),
           "at": time.strftime("%H:%M:%S", time.gmtime())}
    if p.returncode not in (0, 5):
        (out / f"{label}_{Path(file).stem}.log").write_text(p.stdout + p.stderr)
    with open(out / "files.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH (default: new=this checkout)")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (one string, split on spaces)")
    a = ap.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in a.tree] or [("new", HERE.parent)]
    a.out.mkdir(parents=True, exist_ok=True)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for file in a.files:
        for label, tree in trees:
            run_file(label, tree, file, a.out, a.pytest_args.split())


if __name__ == "__main__":
    main()
