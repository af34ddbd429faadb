"""A dead or hung peer (issue "runs that never lose work"): the launcher names the worker that failed
first (not the ones its agent stopped after), and a collective that times out names itself and its peers."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

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



def _hang(sleep_s, out_file):
    """Rank 1 stops participating (sleeps past the timeout); rank 0's all_reduce must fail fast and
    name the collective, the group, the peer and the step (written to ``out_file``; the error then
    propagates, as the process group is broken)."""
    import torch

    from zerotron.distributed import comm

    comm.set_step(7)
    t = torch.ones(4)
    comm.all_reduce(t, tag="grad")  # both ranks: works
    if torch.distributed.get_rank() == 1:
        time.sleep(sleep_s)
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(t, tag="grad")
    except comm.CollectiveError as e:
        Path(out_file).write_text(json.dumps([str(e), time.monotonic() - t0, comm.current_op()]))
        raise


def test_hung_peer_named_within_timeout(tmp_path):
    from zerotron.testing import run_ranks

    with pytest.raises(RuntimeError, match="CollectiveError"):
        run_ranks(_hang, 2, 10.0, str(tmp_path / "out.json"), timeout_s=4, join_timeout_s=120)
    msg, waited, current = json.loads((tmp_path / "out.json").read_text())
    assert msg.startswith("all_reduce (tag 'grad') on group world (ranks [0, 1]) at step 7: rank 0 got no "
                          "answer from peer(s) [1] (dead or hung peer?"), msg
    assert "\n" not in msg and current is None and waited < 4 + 5, (msg, waited)
    print(msg, f"after {waited:.1f}s")
