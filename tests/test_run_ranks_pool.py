"""zerotron.testing.run_ranks' rank pool (zerotron.testing_pool): processes are reused across calls;
a failed call ends its own ranks only (the pooled ranks beyond its world size stay); a rank that
retires (too many threads left behind) is replaced alone. Each respawn costs a rank's imports
(~3-6 s), so the pool's economy is worth a test."""
import os

import pytest

from zerotron import testing_pool
from zerotron.testing import run_ranks


def _pid():
    return os.getpid()


def _fail_on_rank_0():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("rank 0 fails on purpose")
    return os.getpid()


def _retire_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        testing_pool._POOL_MAX_THREADS = 0  # in this rank process only: it retires after answering
    return os.getpid()


def test_pool_reuses_and_replaces_only_what_it_must():
    """Two replacements in all (one after the error, one after the retirement): in a full session
    the first two ranks are usually the pool's already."""
    if os.environ.get("ZEROTRON_TEST_POOL", "1") == "0":
        pytest.skip("ZEROTRON_TEST_POOL=0: every call is fresh")
    first = run_ranks(_pid, 2)
    assert run_ranks(_pid, 2) == first  # the same two processes serve the next call
    with pytest.raises(RuntimeError, match="rank 0 fails on purpose"):
        run_ranks(_fail_on_rank_0, 1)
    after_error = run_ranks(_pid, 2)
    assert after_error[0] != first[0]  # the rank of the failed call replaced
    assert after_error[1] == first[1]  # not in that call: kept
    assert run_ranks(_retire_rank_1, 2) == after_error
    after_retire = run_ranks(_pid, 2)
    assert after_retire[1] != after_error[1] and after_retire[0] == after_error[0]  # the retired one alone
    assert len(set(first + after_error + after_retire)) == 4


def test_a_rank_spawned_beside_a_ready_one_joins_after_its_imports(tmp_path, monkeypatch):
    """A rank spawned for a call beside a pooled rank that is ready (here rank 1, after rank 0 served
    a world-1 call; in a session also after a failed call, a retired rank or a larger world) gets
    its job only once its imports are done, so a collective timeout shorter than those imports
    (test_dead_peer's is 4 s) is not spent in the job's rendezvous waiting for them. The new rank's
    interpreter is slowed by 5 s (a sitecustomize that sleeps), beyond the 2 s timeout of the call;
    before the pool awaited a new rank's "ready", rank 0 gave up: "DistStoreError: Timed out after 3
    seconds waiting for clients. 1/2 clients joined." (and at load 34 a plain rank 1's imports took
    19 s, against a 4 s timeout)."""
    if os.environ.get("ZEROTRON_TEST_POOL", "1") == "0":
        pytest.skip("ZEROTRON_TEST_POOL=0: every call is fresh")
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(5)\n")
    ready = run_ranks(_pid, 1)
    testing_pool._end_ranks([1], "test: rank 1 spawned again, slowly")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    got = run_ranks(_pid, 2, timeout_s=2)
    assert got[0] == ready[0] and got[1] not in ready  # the ready rank 0 and a new rank 1
