"""`zerotron bench checkpoint`: the cost of checkpoint checksums (issue 13's overhead figure)."""
import json
import os
from pathlib import Path

from zerotron.testing_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent


def bench(*args):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return run_cli(["bench", "checkpoint", *args], cwd=ROOT, env=e, timeout=300)  # fork-server child


def test_bench_checkpoint_measures_and_cleans_up(tmp_path, data_cache):
    """Two rounds on the tiny model: every time is positive (no ordering is asserted: timings under
    load), the bytes are the checkpoint's (3 copies of the fp32 state at least), the percentages
    follow from the medians, and nothing is left in --dir. --json names a folder that does not exist
    yet: created, as by every command that writes a result file (zerotron.out_files)."""
    out = tmp_path / "new" / "r.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    r = bench("--config", "configs/tiny.toml", "--rounds", "2", "--dir", str(disk), "--json", str(out),
              "--markdown", str(tmp_path / "r.md"), "--data.cache_dir", data_cache, "--log.progress", "false")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["model"] == "tiny" and res["rounds"] == 2 and len(res["rows"]) == 2
    for row in res["rows"]:
        assert min(row[k] for k in ("save_s", "checksum_s", "verify_s", "verify_checksums_s", "load_s")) > 0
        assert row["bytes"] > 3 * 4 * res["params"]
    assert abs(res["checksum_pct_of_save"] - 100 * res["checksum_s"] / res["save_s"]) < 1e-9
    assert list(disk.iterdir()) == []
    assert "| tiny |" in (tmp_path / "r.md").read_text() and "| tiny |" in r.stdout


def test_bench_checkpoint_bad_arguments():
    r = bench("--rounds", "0")
    assert r.returncode == 2 and r.stderr.strip() == "zerotron bench checkpoint: error: --rounds must be >= 1, got 0", r.stderr
    r = bench("--dir", "/nonexistent/x")
    assert r.returncode == 2 and "--dir /nonexistent/x is not a directory" in r.stderr, r.stderr
    for flag in ("--json", "--markdown"):
        for bad, why in ((str(ROOT / "pyproject.toml" / "d" / "o.json"), f"{ROOT / 'pyproject.toml'} is a file, not a directory"),
                         ("/tmp", "is a directory")):
            r = bench(flag, bad)
            assert r.returncode == 2 and f"{flag} {bad}: {why}" in r.stderr, r.stderr
    # a folder that cannot be written (even by root: /proc): refused before the rounds, not a
    # FileNotFoundError traceback after them
    r = bench("--json", "/proc/o.json")
    assert r.returncode == 2 and "--json /proc/o.json: cannot write there" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = bench("--train.lr", "inf")
    assert r.returncode == 2 and "train.lr must be a finite number" in r.stderr, r.stderr
