"""zerotron.launch_fork: ``--nproc`` workers forked from the launcher start as exec'd ones would.

One launch of 2 probe workers (``python -m zerotron.worker_state``) with exec'd workers and one with
forked workers, each from a run_cli child (a launcher that imported torch and the training stack,
as the tests' launchers have): the workers' session, parent, inherited descriptors, signal
dispositions, atexit handlers, unbuffered streams, environment and torch defaults must be the same
in both. The launcher of this test holds what a real one holds when it starts its workers: an
flock on a run directory's lock file, a SIGTERM handler, an ignored SIGUSR2, an
atexit handler, torch defaults changed and all RNGs seeded. Failure reports and signals with forked workers are
tested by the suite's launches themselves (test_faults, test_dead_peer, test_cli: they run with
ZEROTRON_FORK_WORKERS=1 from conftest)."""
import json
import os

import pytest

from zerotron import host_heap
from zerotron.testing import ROOT
from zerotron.testing_cli import run_cli

_LAUNCHER = """
import atexit, fcntl, json, os, signal, sys
import torch
from zerotron.launch import launch

out, lock = OUT, LOCK
fd = os.open(lock, os.O_CREAT | os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)          # the run directory's lock, held by the launcher
signal.signal(signal.SIGTERM, lambda *a: None)          # a handler of the launcher's own
signal.signal(signal.SIGUSR2, signal.SIG_IGN)           # ignored: exec keeps it ignored
atexit.register(lambda: print("launcher atexit"))
torch.set_default_dtype(torch.float64)
torch.manual_seed(1)
import numpy, random
numpy.random.seed(1)
random.seed(1)
code = launch(2, [out], module="zerotron.worker_state")
print(json.dumps({"code": code, "pid": os.getpid()}))
"""


def _workers(tmp_path, fork: str):
    script = tmp_path / f"launcher_{fork}.py"
    out = tmp_path / f"workers_{fork}.jsonl"
    script.write_text(f"OUT, LOCK = {str(out)!r}, {str(tmp_path / 'run.lock')!r}\n" + _LAUNCHER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRON_FORK_WORKERS": fork}
    env.pop(host_heap.ENV, None)
    r = run_cli([], cwd=ROOT, env=env, timeout=300, script=script)
    assert r.returncode == 0, r.stdout + r.stderr
    launcher = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert launcher["code"] == 0, r.stdout + r.stderr
    rows = sorted((json.loads(ln) for ln in out.read_text().splitlines()), key=lambda s: s["rank"])
    assert [s["rank"] for s in rows] == [0, 1], rows
    for s in rows:
        assert s.pop("parent") == launcher["pid"], (fork, s)  # a child of the launcher, as exec'd
    return rows


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_forked_workers_start_like_exec_ones(tmp_path):
    def normal(rows, out):
        for s in rows:
            assert s["argv_tail"] == [str(out)]
            s["argv_tail"] = "OUT"
        # each interpreter seeds torch's, numpy's and Python's global RNGs anew: different per worker
        assert all(a != b for a, b in zip(rows[0].pop("rng"), rows[1].pop("rng"))), (out, rows)
        return rows

    exec_rows = normal(_workers(tmp_path, "0"), tmp_path / "workers_0.jsonl")
    fork_rows = normal(_workers(tmp_path, "1"), tmp_path / "workers_1.jsonl")
    assert fork_rows == exec_rows
    # and what both must be (so that the comparison cannot pass on a broken exec path either)
    s = exec_rows[0]
    assert s["own_session"] and s["fds"] == {} and s["atexit_handlers"] == 0 and s["unbuffered"] == [True, True]
    assert s["signals"]["SIGTERM"] == "SIG_DFL" and s["signals"]["SIGHUP"] == "SIG_DFL"  # elastic's handlers gone
    assert s["signals"]["SIGUSR2"] == "SIG_IGN"
    assert s["signals"]["SIGINT"] == "default_int_handler" and s["signals"]["SIGPIPE"] == "SIG_IGN"
    assert s["torch"] == {"threads": 1, "dtype": "torch.float32", "grad": True}
    assert s["env"]["WORLD_SIZE"] == "2" and s["env"]["OMP_NUM_THREADS"] == "1"
    if host_heap.wanted({}):  # glibc's thresholds in effect: read from the environment at exec, set by a fork
        assert s["env"]["MALLOC_MMAP_THRESHOLD_"] == str(host_heap.MMAP_THRESHOLD_BYTES) and s["heap_block_reused"]


def test_apply_env_reads_only_the_malloc_variables():
    assert host_heap.apply_env({}) is False  # nothing to set (no mallopt call in this process)
    with pytest.raises(ValueError):
        host_heap.apply_env({"MALLOC_MMAP_THRESHOLD_": "lots"})


def test_no_fork_from_a_process_with_a_process_group(single_process):
    """A launcher that holds a default process group (a test's process after a single-process run)
    exec's its workers: a fork would copy the group into each worker."""
    from zerotron import launch_fork

    assert not launch_fork.wanted({launch_fork.ENV: "1"})
    assert not launch_fork.wanted({launch_fork.ENV: "0"})
