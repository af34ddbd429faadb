"""Every run ends with mesh.teardown(): outstanding async collectives waited for, a barrier, then the
process group destroyed. (The exit-time abort this prevents is a race and not reproducible on
demand; these tests check the invariant instead.)"""
import json
import os
import time
from pathlib import Path

from zerotron.testing import ROOT, run_ranks

TINY = str(ROOT / "configs" / "tiny.toml")


def _instrument(events: list):
    """Wrap mesh.teardown and the steps it must take, appending to ``events``; each teardown call
    then appends ``("after", pending async works, group still initialised)``. Returns a function
    that restores the originals."""
    import torch.distributed as dist

    from zerotron.distributed import comm, inflight, mesh

    originals = [(inflight, "wait_pending"), (comm, "barrier"), (mesh, "destroy"), (mesh, "teardown")]
    originals = [(mod, name, getattr(mod, name)) for mod, name in originals]

    def recorder(real, tag):
        def wrapped(*a, **k):
            events.append(tag)
            return real(*a, **k)
        return wrapped

    for mod, name, real in originals[:3]:
        setattr(mod, name, recorder(real, name))
    real_teardown = mesh.teardown

    def teardown():
        events.append("teardown")
        real_teardown()
        events.append(("after", len(inflight.pending_works()), dist.is_initialized()))

    mesh.teardown = teardown

    def restore():
        for mod, name, real in originals:
            setattr(mod, name, real)
    return restore


def _unwaited_async(out_dir):
    """Rank 0 issues an async all-reduce and returns without waiting; rank 1 joins that collective
    only after rank 0 has entered teardown, so the work is certainly pending there."""
    import torch
    import torch.distributed as dist

    from zerotron.distributed import comm, inflight, mesh

    rank, events = dist.get_rank(), []
    _instrument(events)
    entered = Path(out_dir) / "rank0_in_teardown"
    t = torch.full((1000,), float(rank + 1))
    if rank == 0:
        comm.all_reduce(t, async_op=True, tag="test")
        inner = mesh.teardown

        def teardown():
            pending = len(inflight.pending_works())
            entered.write_text("1")
            inner()
            (Path(out_dir) / "rank0.json").write_text(json.dumps({"pending_at_entry": pending, "events": events,
                                                                  "sum": t.tolist()}))
        mesh.teardown = teardown
    else:
        deadline = time.monotonic() + 30
        while not entered.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        comm.all_reduce(t, async_op=True, tag="test")
    return rank


def test_run_ranks_worker_waits_pending_then_barrier_then_destroy(tmp_path):
    # fresh ranks: rank 0's teardown is instrumented (replaced) for good
    assert run_ranks(_unwaited_async, 2, str(tmp_path), timeout_s=30, join_timeout_s=120, fresh=True) == [0, 1]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["pending_at_entry"] >= 1  # the all-reduce was still running when rank 0 got there
    assert r0["events"] == ["teardown", "wait_pending", "barrier", "destroy", ["after", 0, False]], r0
    assert r0["sum"] == [3.0] * 1000  # waited for, not torn down under the collective


def _env_and_stdout(key):
    print(f"rank {os.environ['RANK']} writes to the caller's stdout", flush=True)
    return os.environ.get(key), os.getpid()


def test_run_ranks_ranks_get_the_callers_environment_and_stdout(monkeypatch, capfd):
    """run_ranks reuses its pooled rank processes across calls (zerotron.testing): each rank must
    still see the caller's environment as it is at the call (not as it was when the pool started)
    and write to the caller's stdout (this test's capture), as a freshly spawned rank does."""
    monkeypatch.setenv("ZEROTRON_TEST_RUN_RANKS_ENV", "first")
    first = run_ranks(_env_and_stdout, 2, "ZEROTRON_TEST_RUN_RANKS_ENV")
    monkeypatch.setenv("ZEROTRON_TEST_RUN_RANKS_ENV", "second")
    second = run_ranks(_env_and_stdout, 2, "ZEROTRON_TEST_RUN_RANKS_ENV")
    assert [v for v, _ in first] == ["first", "first"] and [v for v, _ in second] == ["second", "second"]
    assert os.getpid() not in {pid for _, pid in first + second}
    out = capfd.readouterr().out
    assert out.count("rank 0 writes to the caller's stdout") == 2 and out.count("rank 1 writes") == 2, out


def _entry_points(tmp, cache):
    """Run train, bench train, generate and export in this process as one process alone would
    (no process group yet); per command: its exit code and the instrumented teardown events."""
    from zerotron.cli import main
    from zerotron.distributed import mesh

    mesh.destroy()  # run_ranks' group: each command must create (and end) its own
    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k)
    common = ["--config", TINY, "--model.n_layer", "1", "--data.cache_dir", cache, "--log.progress", "false",
              "--log.plot", "false", "--log.sample_tokens", "0"]
    run = str(Path(tmp) / "run")
    commands = {"train": ["train", *common, "--run-dir", run, "--train.steps", "1", "--train.eval_every", "0"],
                "bench train": ["bench", "train", *common, "--layouts", "single", "--steps", "1", "--warmup", "0",
                                "--rounds", "1"],
                "generate": ["generate", "--checkpoint", run, "--prompt", "ROMEO:", "--max-new-tokens", "2"],
                "export": ["export", "--checkpoint", run, "--out", str(Path(tmp) / "hf")]}
    out = {}
    for name, argv in commands.items():
        events = []
        restore = _instrument(events)
        try:
            out[name] = (main(argv), events)
        finally:
            restore()
    return out


def test_every_entry_point_ends_with_teardown(tmp_path, data_cache):
    out = run_ranks(_entry_points, 1, str(tmp_path), data_cache, timeout_s=60, join_timeout_s=300, fresh=True)[0]
    # per command: exit code 0 and exactly one teardown, at the end, its steps in order; nothing
    # pending and no process group left afterwards
    ordered = ["teardown", "wait_pending", "barrier", "destroy", ("after", 0, False)]
    got = {name: (code, events.count("teardown"), events[events.index("teardown"):] if "teardown" in events else [])
           for name, (code, events) in out.items()}
    assert got == {name: (0, 1, ordered) for name in ("train", "bench train", "generate", "export")}, got
