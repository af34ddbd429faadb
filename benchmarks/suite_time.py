"""Per-file wall and CPU seconds of the test suite, one pytest process per file, optionally paired.

``python benchmarks/suite_time.py --out DIR [--tree LABEL=PATH ...] tests/test_a.py tests/test_b.py``
runs, for each file and then for each tree in turn (so the arms of a pair run back to back),
``python -m pytest -o addopts= -q -p no:cacheprovider -p pytest_cputime FILE`` in that tree (its own
``PYTHONPATH``), under ``nice -n 10``. This process makes itself a child subreaper, so every process
of the tree (orphans too) is reaped here and counted: per file it records the wall seconds and the
user + system CPU seconds of everything the run started (``RUSAGE_CHILDREN`` before/after), the
exit code and pytest's last line, the 1-minute load average at start and end, and the per-test
figures of :mod:`pytest_cputime` (``DIR/LABEL.jsonl``) and the rank pool's spawns
(``DIR/LABEL_pool.log``, trees whose ``zerotron.testing`` writes it). Results: ``DIR/files.jsonl``. On a loaded
machine only the CPU seconds and the pairs mean much; say the load when quoting them."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shlex
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


def run_file(label: str, tree: Path, file: str, out: Path, extra: list[str], tree_env: dict) -> dict:
    env = {**os.environ, **tree_env, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}", "ZEROTRON_CPUTIME_OUT": str(out / f"{label}.jsonl"),
           "ZEROTRON_TEST_POOL_LOG": str(out / f"{label}_pool.log"), "PYTHONDONTWRITEBYTECODE": "1"}
    if "--proc-log" in sys.argv:  # every fresh interpreter of the run logged (proc_log/sitecustomize.py)
        env["ZEROTRON_PROC_LOG"] = str(out / f"{label}_{Path(file).stem}_proc.log")
        env["PYTHONPATH"] = f"{HERE / 'proc_log'}{os.pathsep}{env['PYTHONPATH']}"
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


def report(out: Path) -> str:
    """A markdown table of ``DIR/files.jsonl``: per file and tree, wall and CPU seconds (the last
    run of each pair), the load at start, and the CPU ratio of the last tree to the first."""
    recs = [json.loads(ln) for ln in (out / "files.jsonl").read_text().splitlines() if ln.strip()]
    labels = list(dict.fromkeys(r["tree"] for r in recs))
    files = list(dict.fromkeys(r["file"] for r in recs))
    last = {(r["file"], r["tree"]): r for r in recs}
    head = ["file"] + [f"{lb} {k}" for lb in labels for k in ("wall s", "CPU s")] + ["load"]
    if len(labels) > 1:
        head += [f"CPU {labels[-1]}/{labels[0]}", f"wall {labels[-1]}/{labels[0]}"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" + " ---: |" * (len(head) - 1)]
    total = {lb: [0.0, 0.0] for lb in labels}
    for f in files:
        got = [last.get((f, lb)) for lb in labels]
        cells = [f"`{Path(f).name}`"]
        for lb, r in zip(labels, got):
            cells += ["" if r is None else f"{r['wall_s']:.1f}", "" if r is None else f"{r['cpu_s']:.1f}"]
            if r is not None and all(g is not None for g in got):
                total[lb][0] += r["wall_s"]
                total[lb][1] += r["cpu_s"]
            if r is not None and r["rc"] not in (0, 5):
                cells[-1] += f" (exit {r['rc']})"
        cells.append("/".join(f"{r['load_start']:.0f}" for r in got if r is not None))
        if len(labels) > 1:
            a, b = got[0], got[-1]
            cells += [f"{b['cpu_s'] / a['cpu_s']:.2f}" if a and b else "", f"{b['wall_s'] / a['wall_s']:.2f}" if a and b else ""]
        rows.append("| " + " | ".join(cells) + " |")
    cells = ["**sum (files with every tree)**"]
    for lb in labels:
        cells += [f"**{total[lb][0]:.1f}**", f"**{total[lb][1]:.1f}**"]
    cells.append("")
    if len(labels) > 1 and total[labels[0]][1]:
        a, b = total[labels[0]], total[labels[-1]]
        cells += [f"**{b[1] / a[1]:.2f}**", f"**{b[0] / a[0]:.2f}**"]
    rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--report", action="store_true", help="print the markdown table of DIR's results and exit")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=PATH[,VAR=VALUE...]: a tree and environment variables for its runs "
                         "(default: new=this checkout)")
    ap.add_argument("--alternate", action="store_true", help="reverse the trees' order on every other file "
                    "(a load that drifts then favours neither arm)")
    ap.add_argument("--proc-log", action="store_true", help="log every fresh interpreter of each run "
                    "(DIR/LABEL_FILE_proc.log, see proc_log/sitecustomize.py): count them with grep -c ^START")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (one string, split as a shell would)")
    a = ap.parse_args()
    if a.report:
        print(report(a.out))
        return
    trees = []
    for t in a.tree:
        label, rest = t.split("=", 1)
        path, *pairs = rest.split(",")
        trees.append((label, Path(path).resolve(), dict(kv.split("=", 1) for kv in pairs)))
    trees = trees or [("new", HERE.parent, {})]
    a.out.mkdir(parents=True, exist_ok=True)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for i, file in enumerate(a.files):
        for label, tree, tree_env in (trees[::-1] if a.alternate and i % 2 else trees):
            run_file(label, tree, file, a.out, shlex.split(a.pytest_args), tree_env)


if __name__ == "__main__":
    main()
