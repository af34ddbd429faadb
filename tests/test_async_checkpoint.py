"""Asynchronous checkpoints (issue 32, ``checkpoint.async_save``): the same files as a synchronous
save, ``ckpt_blocked_s`` in metrics.jsonl for every save, a kill -9 during the background write
leaves the previous checkpoint as the newest one (and resume equals an uninterrupted run bitwise),
and SIGTERM while a write is pending completes it and the stop's own checkpoint."""
import json
import os
import signal
from pathlib import Path

import torch

from zerotron.testing import checkpoint_flat, run_ranks
from zerotron.testing_cli import run_cli
from zerotron.train.checkpoint import list_checkpoints, verify_checkpoint
from zerotron.train.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


def args(run, cache, *extra):
    return ["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run),
            "--train.steps", str(STEPS), "--train.micro_batch", "2", "--parallel.zero_stage", "1",
            "--checkpoint.every", "2", "--checkpoint.keep", "0", "--data.cache_dir", cache,
            "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false", *extra]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def same_state(a_dir, b_dir, tmp):
    a, b = checkpoint_flat(a_dir, tmp / "a.pt"), checkpoint_flat(b_dir, tmp / "b.pt")
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_metrics_amend_written_and_held(tmp_path, monkeypatch):
    """``MetricsWriter.amend`` adds fields to the newest record: rewritten in place when it is on
    disk (whole lines only), changed in memory when it is held after a failed append."""
    w = MetricsWriter(tmp_path / "m.jsonl")
    w.write({"step": 1, "loss": 2.0})
    w.write({"step": 2, "loss": 1.5})
    w.amend({"ckpt_blocked_s": 0.25})
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1, "loss": 2.0},
                                                  {"step": 2, "loss": 1.5, "ckpt_blocked_s": 0.25}]
    real = os.write

    def full(fd, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    try:
        w.write({"step": 3, "loss": 1.0})
    except Exception as e:  # noqa: BLE001 - MetricsWriteError
        assert "step 3" in str(e)
    w.amend({"ckpt_blocked_s": 0.5})
    assert w.held_steps == [3]
    monkeypatch.setattr(os, "write", real)
    w.close()
    assert read_metrics(tmp_path / "m.jsonl")[-1] == {"step": 3, "loss": 1.0, "ckpt_blocked_s": 0.5}


def _train(run_dir, cache, async_save, resume=False):
    """2-rank in-process run of the same config as :func:`args` (the pool's ranks)."""
    from zerotron.testing import tiny_config
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0", "train.steps": STEPS,
                       "train.micro_batch": 2, "data.cache_dir": cache, "checkpoint.every": 2, "checkpoint.keep": 0,
                       "parallel.zero_stage": 1, "checkpoint.async_save": str(async_save).lower()})
    Trainer(cfg, run_dir, resume=resume).fit()


def test_async_save_kill9_then_resume(tmp_path, data_cache):
    """2 ranks, ZeRO-1, a checkpoint every 2 steps. A synchronous reference run; an async
    `zerotron train` whose writes are slowed (ZEROTRON_FAULT_SLOW_SAVE_S) is kill -9'd (rank 0)
    after step 5, while the background write of step 4 is pending: step_2 stays the newest
    checkpoint (step 4's gather and files, in ``.tmp_step_4``, never renamed); the async resume ends with
    every checkpoint equal to the reference bitwise, and each save's ``ckpt_blocked_s`` is in
    metrics.jsonl (async for the periodic saves, not for the final one)."""
    ref, run = tmp_path / "ref", tmp_path / "async"
    run_ranks(_train, 2, str(ref), data_cache, False)
    r = run_cli(args(run, data_cache, "--checkpoint.async_save", "true"), cwd=ROOT, timeout=300,
                env=env(ZEROTRON_FAULT_SLOW_SAVE_S="3", ZEROTRON_FAULT_KILL_AT_STEP="5", ZEROTRON_FAULT_KILL_RANK="0"))
    assert r.returncode != 0 and "worker 0 failed first (killed by SIGKILL" in r.stderr, r.stderr
    assert [s for s, _ in list_checkpoints(run)] == [2], r.stderr
    # the killed write was pending (slowed by 3 s before its rename): never renamed; its files may not exist
    # yet, as the ZeRO shard gather runs first in the background
    assert not (run / "checkpoints" / "step_4").exists()
    verify_checkpoint(run / "checkpoints" / "step_2")
    run_ranks(_train, 2, str(run), data_cache, True, True)
    assert [s for s, _ in list_checkpoints(run)] == [2, 4, 6]
    for s in (2, 4, 6):
        same_state(ref / "checkpoints" / f"step_{s}", run / "checkpoints" / f"step_{s}", tmp_path)
    recs, refs = read_metrics(run / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [x["loss"] for x in recs] == [x["loss"] for x in refs] and len(refs) == STEPS
    assert [(x["step"], x["ckpt_async"]) for x in recs if "ckpt_blocked_s" in x] == [(2, True), (4, True), (6, False)]
    assert [x["step"] for x in refs if "ckpt_blocked_s" in x and not x["ckpt_async"]] == [2, 4, 6]


def _sigterm_run(run_dir, cache):
    """Rank 0 sends itself SIGTERM in the callback of step 3, while the background write of step 2
    (slowed by ZEROTRON_FAULT_SLOW_SAVE_S) is pending."""
    import torch.distributed as dist

    from zerotron.testing import tiny_config
    from zerotron.train.lifecycle import RunStopped
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0", "train.steps": 6,
                       "train.micro_batch": 2, "data.cache_dir": cache, "checkpoint.every": 2,
                       "checkpoint.async_save": "true"})
    tr = Trainer(cfg, run_dir)
    pending = []

    def cb(t, rec):
        if rec["step"] == 3:
            pending.append(t.saver.pending_step)
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGTERM)
    try:
        tr.fit(callback=cb)
    except RunStopped as e:
        return pending, e.exit_code, str(e)
    return pending, 0, ""


def test_sigterm_waits_for_pending_save(tmp_path, data_cache, monkeypatch):
    """SIGTERM while an async write is pending (2 ranks): the pending checkpoint and the stop's own
    are both complete and valid, nothing is left half-written, exit 143."""
    monkeypatch.setenv("ZEROTRON_FAULT_SLOW_SAVE_S", "2")
    run = tmp_path / "run"
    (p0, code, msg), (p1, _, _) = run_ranks(_sigterm_run, 2, str(run), data_cache)
    assert p0 == p1 == [2]  # step 2's write was still in flight when the signal came
    assert code == 143 and "stopped by SIGTERM" in msg, msg
    n = int(msg.split("at step ")[1].split(";")[0])
    assert n >= 3 and [s for s, _ in list_checkpoints(run)] == [2, n]
    for s in (2, n):
        verify_checkpoint(run / "checkpoints" / f"step_{s}")
    assert not list((run / "checkpoints").glob(".tmp_step_*"))
    recs = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in recs if "ckpt_blocked_s" in x] == [2, n]
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 143


def _snapshot_equals_state(cache, cases):
    """Per case: train 2 fp64 steps, take ``checkpoint_state`` and a ``checkpoint_snapshot``, change
    every live shard and moment, then finish the snapshot on stand-in groups (in a thread, as the
    background writer does); returns whether every tensor and step equals the state before."""
    import threading

    from zerotron.testing import tiny_config
    from zerotron.train.checkpoint.background import stand_in_groups
    from zerotron.train.trainer import Trainer

    out = []
    for over in cases:
        cfg = tiny_config({"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0", "train.steps": 2,
                           "train.micro_batch": 2, "data.cache_dir": cache, "checkpoint.every": 0,
                           "checkpoint.save_final": "false", "train.dtype": "fp64", "train.eval_every": 0, **over})
        import tempfile
        tr = Trainer(cfg, tempfile.mkdtemp())
        tr.fit()
        s, opt = tr.strategy, tr.optimizer
        want_m, want_o = s.checkpoint_state(opt)
        stand_ins = stand_in_groups(s.checkpoint_groups())
        finish = s.checkpoint_snapshot(opt, {})
        with torch.no_grad():
            for f in s.grad_flats:
                f.master.add_(1.0)
                for v in opt.state[f.master].values():
                    v.add_(1.0)
        got = []
        t = threading.Thread(target=lambda: got.append(finish(stand_ins)))
        t.start()
        t.join()
        got_m, got_o = got[0]
        ok = want_m.keys() == got_m.keys() and all(torch.equal(want_m[k], got_m[k]) for k in want_m)
        ok = ok and want_o["state"].keys() == got_o["state"].keys() and want_o["param_groups"] == got_o["param_groups"]
        for k, st in want_o["state"].items():
            ok = ok and all(torch.equal(v, got_o["state"][k][n]) for n, v in st.items())
        out.append((ok, len(want_m)))
    return out


def test_zero_snapshot_gathers_in_background(data_cache):
    """Async saves of native ZeRO copy only this rank's shards in the foreground and gather them
    later on stand-in groups: the gathered state is the one at the snapshot (dp 2 ZeRO-1 and -3,
    tp 2 ZeRO-3 whose tp shards are gathered on the stand-in of the tp group)."""
    cases = [{"parallel.zero_stage": 1}, {"parallel.zero_stage": 3}, {"parallel.zero_stage": 3, "parallel.tp": 2}]
    for rank_out in run_ranks(_snapshot_equals_state, 2, data_cache, cases):
        assert all(ok and n > 0 for ok, n in rank_out), rank_out


def _background_save_with_a_stopped_peer(run_dir):
    """Rank 0 stops rank 1 (SIGSTOP: a hung rank, its sockets open) and starts a background save of
    a one-tensor state, then waits for it; rank 1 was idle, outside any collective. Returns rank 0's
    (error type, message); rank 1 is continued (SIGCONT) either way."""
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from zerotron.train.checkpoint.background import AsyncSaver

    lin = torch.nn.Linear(4, 4)
    strategy = SimpleNamespace(module=lin, checkpoint_state=lambda opt: ({"w": lin.weight.detach()}, {}))
    saver = AsyncSaver(strategy)  # collective: its own gloo group, as every rank of a run makes it
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    done = Path(run_dir) / "continued"
    if dist.get_rank() == 1:
        while not done.exists():  # idle: no collective of its own while it is stopped
            time.sleep(0.02)
        return None
    os.kill(pids[1], signal.SIGSTOP)
    try:
        saver.start(run_dir, 1, strategy, None, SimpleNamespace(state_dict=dict), {})
        _, err, _ = saver.wait()
        return type(err).__name__, str(err)
    finally:
        done.touch()
        os.kill(pids[1], signal.SIGCONT)


def test_background_save_with_a_hung_peer_fails_within_the_timeout(tmp_path):
    """A background save's collectives (its own gloo group, made with dist.new_group) had torch's
    30-minute timeout, not parallel.timeout_s, and their failures were gloo's bare RuntimeError (the
    writer thread was left out of the watchdog): a rank stopped during a background save held the
    others 30 minutes, then a traceback. Now rank 0's wait for the save ends within the collective
    timeout (4 s here; a hang would end in run_ranks' join timeout) with the watchdog's one-line
    CollectiveError naming the save's agreement, its group and the stopped peer; nothing is written."""
    run = tmp_path / "run"
    run.mkdir()
    out = run_ranks(_background_save_with_a_stopped_peer, 2, str(run), timeout_s=4, join_timeout_s=240)
    kind, msg = out[0]
    assert kind == "CollectiveError", (kind, msg)
    assert msg.startswith("all_reduce (tag 'checkpoint_agree') on group checkpoint (ranks [0, 1])") and \
        "rank 0 got no answer from peer(s) [1] (dead or hung peer?" in msg and "\n" not in msg, msg
    assert not list_checkpoints(run) and not list((run / "checkpoints").glob(".tmp_step_*"))
