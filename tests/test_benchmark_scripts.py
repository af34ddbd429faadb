"""benchmarks/planner_validation.sh: by default it writes to a fresh temporary directory and never
over the committed results; OUT=DIR writes to DIR (the zerotron commands are replaced by a stub
that records its arguments)."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "planner_validation.sh"


def _run(tmp_path, out=None) -> tuple[list[list[str]], str]:
    log = tmp_path / "calls.txt"
    stub = tmp_path / "zt"
    stub.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update({"ZEROTRON": str(stub), "TMPDIR": str(tmp_path)})
    if out:
        env["OUT"] = str(out)
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [ln.split() for ln in log.read_text().splitlines()], r.stdout


def _paths(calls) -> list[str]:
    return [a[i + 1] for a in calls for i, x in enumerate(a) if x in ("--json", "--plot", "--markdown", "--out")]


def test_default_writes_to_a_fresh_temporary_directory(tmp_path):
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").iterdir()}
    calls, out = _run(tmp_path)
    assert [c[:2] for c in calls] == [["bench", "comm"], ["bench", "train"], ["bench", "plan"]]
    paths = _paths(calls)
    dirs = {str(Path(p).parent) for p in paths}
    assert len(paths) == 7 and len(dirs) == 1, paths
    (d,) = dirs
    assert Path(d).parent == tmp_path and Path(d).name.startswith("planner_validation."), d
    assert f"written to {d}/planner_validation.md" in out
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").iterdir()} == before


def test_out_names_the_directory(tmp_path):
    calls, _ = _run(tmp_path, out=tmp_path / "mine")
    assert {str(Path(p).parent) for p in _paths(calls)} == {str(tmp_path / "mine")}


BENCH_TRAIN_RESULTS = ("planner_layouts_cpu", "epoch_1_vs_2", "strategies_cpu", "train_cpu")


def test_committed_bench_train_tables_match_their_json():
    """Each committed ``bench train`` table is what today's formatter prints for its JSON (impl
    names such as TensorParallel for the tp layouts, ``- (1 rank)`` instead of comm bytes on one
    rank): a table left from an older formatter, or a JSON edited without its table, fails."""
    import json

    from zerotron.bench.report import format_table

    for name in BENCH_TRAIN_RESULTS:
        rows = json.loads((ROOT / "benchmarks" / f"{name}.json").read_text())
        md = (ROOT / "benchmarks" / f"{name}.md").read_text()
        assert format_table(rows) in md, f"benchmarks/{name}.md: its table differs from format_table({name}.json)"
        for r in rows:
            if r["layout"].split("-")[0] == "tp" and r["layout"] != "tp-dtensor":
                assert r["impl"].startswith("TensorParallel"), (name, r["layout"], r["impl"])
