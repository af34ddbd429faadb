"""A dead or hung peer (issue "runs that never lose work"): the launcher names the worker that failed
first (not the ones its agent stopped after), and a collective that times out names itself and its peers."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from zerotron.launch import describe_failures

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--log.progress", "false", "--log.plot", "false", "--log.sample_tokens", "0"]


def train(run_dir, cache, *extra, env=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    argv = ["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run_dir),
            "--data.cache_dir", cache, "--train.steps", "4", "--train.eval_every", "0", *QUIET, *extra]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "zerotron", *argv], cwd=ROOT, env=e, capture_output=True,
                       text=True, timeout=300, check=False)
    return r, time.monotonic() - t0


def ours(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("zerotron:")]


def test_describe_failures_names_first_culprit():
    f = SimpleNamespace
    line = describe_failures({0: f(exitcode=-signal.SIGTERM, timestamp=5), 1: f(exitcode=-signal.SIGKILL, timestamp=6)})
    assert line == ("worker 1 failed first (killed by SIGKILL: possibly out of memory (check dmesg)); "
                    "the agent then stopped worker(s) [0]. See its messages above.")
    line = describe_failures({0: f(exitcode=1, timestamp=7), 1: f(exitcode=1, timestamp=3)})
    assert line.startswith("worker 1 failed first (exit code 1); also failed: [0]")
    assert describe_failures({2: f(exitcode=-signal.SIGTERM, timestamp=1)}).startswith(
        "worker 2 failed first (killed by SIGTERM)")


def test_kill9_of_rank1_named(tmp_path, data_cache):
    r, _ = train(tmp_path / "run", data_cache, env={"ZEROTRON_FAULT_KILL_AT_STEP": "2",
                                                    "ZEROTRON_FAULT_KILL_RANK": "1"})
    assert r.returncode == 1, r.stderr
    assert ours(r.stderr)[-1].startswith(
        "zerotron: worker 1 failed first (killed by SIGKILL: possibly out of memory (check dmesg))"), r.stderr
