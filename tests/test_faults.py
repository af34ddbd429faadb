"""Fault injection (issue 13, "runs that never lose work"): non-finite steps, a second run on the
same directory, SIGTERM/SIGINT, a torn metrics line, a damaged checkpoint, a full disk. Each test
reproduces the fault and checks: one clear line, nothing lost, resume equal where it applies."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zerotron.cli import main
from zerotron.testing import checkpoint_flat, run_ranks, run_ranks_captured, tiny_config
from zerotron.testing_cli import run_cli
from zerotron.train.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0"}


def strict_load(path):
    def refuse(c):
        raise AssertionError(f"{path}: non-strict JSON constant {c}")
    return json.loads(Path(path).read_text(), parse_constant=refuse)


def cli(*args, env=None, check=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    r = run_cli(list(args), cwd=ROOT, env=e, timeout=300)  # `python -m zerotron ...`, imports preloaded
    if check is not None:
        assert r.returncode == check, f"exit {r.returncode} != {check}:\n{r.stdout}\n{r.stderr}"
    return r


def ours(stderr: str) -> list[str]:
    """zerotron's own lines of stderr (not torch elastic's logging)."""
    return [ln for ln in stderr.splitlines() if ln.startswith("zerotron:")]


# ---- 1. non-finite guard -------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--train.lr", "inf"], "train.lr must be a finite number, got inf"),
    (["--train.beta1", "2"], "train.beta1 and train.beta2 must be in [0, 1)"),
    (["--train.eps", "-1"], "train.eps must be > 0"),
    (["--train.weight_decay", "-1"], "train.weight_decay must be >= 0"),
    (["--parallel.timeout_s", "inf"], "parallel.timeout_s must be a finite number"),
    # too large for torch's timers: was an OverflowError traceback (1e15) or every rendezvous failing (1e10)
    (["--parallel.timeout_s", "1e10"], "parallel.timeout_s must be > 0 and at most 31,536,000 seconds"),
    # the grace timer: was an OverflowError traceback in the timer thread at the first SIGTERM
    (["--train.stop_grace_s", "1e300"], "train.stop_grace_s must be > 0 and at most 31,536,000 seconds"),
    # the BPE trainer's tables: was a 70 GB allocation and an abort inside Rust (exit 134)
    (["--data.vocab_size", "1000000000"], "data.vocab_size must be at most 1,048,576"),
    (["--train.grad_clip", "nan"], "train.grad_clip must be a finite number"),
    (["--train.nonfinite", "ignore"], "train.nonfinite must be skip or stop"),
    (["--train.nonfinite_limit", "0"], "train.nonfinite_limit must be >= 1"),
    # the grace timer's wait overflowed (threading.Timer: "timestamp out of range"): a traceback at the first signal
])
def test_nonfinite_config_refused(argv, message, capsys, tmp_path):
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()  # nothing left on disk by a refused run


def test_generate_temperature_nan_refused(capsys):
    code = main(["generate", "--checkpoint", "/no/such", "--prompt", "hi", "--temperature", "nan"])
    err = capsys.readouterr().err
    assert code == 2 and "--temperature must be a finite number >= 0" in err and "got nan" in err, err


def _digest(tr) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for p in tr.strategy.parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _skip_run(run_dir, cache):
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**QUIET, "train.steps": 5, "train.micro_batch": 2, "data.cache_dir": cache,
                       "checkpoint.every": 0})
    tr = Trainer(cfg, run_dir)
    seen = [(0, _digest(tr))]
    summary = tr.fit(callback=lambda t, rec: seen.append((rec["step"], _digest(t), rec["lr"], rec["skipped_steps"])))
    return seen, summary


def test_nonfinite_skip_agreed_by_all_ranks(tmp_path, data_cache, monkeypatch):
    """A NaN in one rank's gradient (after the sync) at step 3: both ranks skip the same step (no
    update, LR not advanced), stay identical, and metrics/summary stay strict JSON."""
    monkeypatch.setenv("ZEROTRON_FAULT_NAN_AT_STEPS", "3")
    monkeypatch.setenv("ZEROTRON_FAULT_NAN_RANK", "1")
    (r0, s0), (r1, _) = run_ranks(_skip_run, 2, str(tmp_path / "run"), data_cache)
    assert r0 == r1                                     # same decision, same parameters on both ranks
    by = {rec[0]: rec for rec in r0}
    assert by[3][1] == by[2][1] != by[4][1]             # step 3 changed nothing, step 4 trained
    assert by[4][2] == by[3][2]                         # the LR schedule did not advance at step 3
    assert [by[s][3] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert s0["skipped_steps"] == 1
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 5
    strict_load(tmp_path / "run" / "summary.json")


def test_skipped_step_warns_once_on_rank_0(capsys):
    """A skipped step is not silent: rank 0 prints one warning line naming the step and how many
    skips in a row remain allowed; other ranks print nothing."""
    from zerotron.train.lifecycle import StepGuard

    for rank in (0, 1):
        g = StepGuard("skip", 3, None, rank)
        g.step, g.last_skipped, g.consecutive = 3, True, 1
        g.check(float("nan"), float("inf"), None)
        err = capsys.readouterr().err
        if rank:
            assert err == ""
        else:
            assert err == ("zerotron: warning: non-finite loss or gradient norm at step 3 on some rank (rank 0: loss nan, "
                           "grad norm inf); "
                           "the update was skipped on every rank (1 of 2 allowed in a row, "
                           "train.nonfinite_limit = 3)\n"), err


def test_nonfinite_stop_mode(tmp_path, data_cache, single_process, monkeypatch):
    from zerotron.train.lifecycle import RunStopped
    from zerotron.train.trainer import Trainer

    monkeypatch.setenv("ZEROTRON_FAULT_NAN_AT_STEPS", "3")
    cfg = tiny_config({**QUIET, "train.steps": 4, "data.cache_dir": data_cache, "checkpoint.every": 2,
                       "train.nonfinite": "stop"})
    with pytest.raises(RunStopped, match="at step 3 .*train.nonfinite = stop.*checkpoints/step_2") as e:
        Trainer(cfg, tmp_path / "run").fit()
    assert e.value.exit_code == 3
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_python_api_never_writes_over_a_run(tmp_path, data_cache, single_process):
    """Trainer(cfg, dir) over a directory that holds a run refuses before writing; a second fit()
    on one trainer refuses (it would rewrite the metrics); resume=True continues."""
    from zerotron.config import ConfigError
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**QUIET, "train.steps": 2, "data.cache_dir": data_cache, "checkpoint.every": 2})
    tr = Trainer(cfg, tmp_path / "run")
    tr.fit()
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(RuntimeError, match="already called"):
        tr.fit()
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before
    cfg.train.steps = 3
    assert Trainer(cfg, tmp_path / "run", resume=True).fit()["steps"] == 3


def test_diverging_run_stops_after_limit(tmp_path, data_cache):
    """The issue's reproduction: lr 50 makes the grad norm inf from step 13; three consecutive
    skips stop the run (exit 3, one line naming the step); every checkpoint is finite. A stop on
    purpose is not restarted by --max-restarts (it would stop the same way again)."""
    run = tmp_path / "div"
    r = cli("train", "--config", "configs/tiny.toml", "--nproc", "2", "--max-restarts", "1", "--run-dir", str(run),
            "--train.steps", "24",
            "--train.lr", "50", "--train.warmup_steps", "16", "--checkpoint.every", "2", "--checkpoint.keep", "2",
            "--data.cache_dir", data_cache, "--log.progress", "false", "--log.sample_tokens", "0", check=3)
    warned = [ln for ln in ours(r.stderr) if "non-finite" in ln and "was skipped on every rank" in ln]
    lines = [ln for ln in ours(r.stderr) if "non-finite" in ln and ln not in warned]
    assert len(lines) == 1 and "consecutive skipped steps" in lines[0], r.stderr
    assert len(warned) == 2 and "(1 of 2 allowed" in warned[0] and "(2 of 2 allowed" in warned[1], r.stderr
    assert "restart" not in r.stderr, r.stderr
    step = int(lines[0].split("at step ")[1].split()[0])
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == step and recs[-1]["skipped_steps"] >= 3 and "NaN" not in (run / "metrics.jsonl").read_text()
    cks = list_checkpoints(run)
    assert cks and cks[-1][0] <= step and len(cks) == 2
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(cks[-1][1]), str(tmp_path / "last.pt"))
    model = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in model.values() if isinstance(v, torch.Tensor))


# ---- 2. run-directory lock -----------------------------------------------------------------------

def test_second_run_on_locked_dir_refused(tmp_path):
    """This (pytest) process holds the lock; a real second `zerotron train` process on the same
    directory is refused with one line naming the holder, and touches nothing."""
    from zerotron.train.run_lock import RunLock

    run = tmp_path / "run"
    held = RunLock(run, heartbeat_s=3600)  # no heartbeat rewrites the file during the comparison
    assert held.acquire() is None
    before = (run / ".lock").read_bytes()
    r = cli("train", "--config", "configs/tiny.toml", "--run-dir", str(run), check=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is in use by pid {os.getpid()}" in lines[0], r.stderr
    assert (run / ".lock").read_bytes() == before and [p.name for p in run.iterdir()] == [".lock"]
    held.release()
    assert (run / ".lock").read_bytes() == b""


def test_stale_lock_taken_over(tmp_path):
    from zerotron.train.run_lock import RunLock

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid, "start": "x"}))
    lock = RunLock(tmp_path)
    msg = lock.acquire()
    assert msg and f"stale lock {tmp_path / '.lock'} of pid {dead.pid}" in msg and "no longer running" in msg
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": "x"}))
    from zerotron.config import ConfigError

    with pytest.raises(ConfigError, match="locked by pid 1 on host elsewhere"):
        RunLock(tmp_path).acquire()


def _foreign_lock(run_dir, age_s, **extra):
    """A lock file as a run on another host (NFS, flock not reaching across hosts) leaves it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rec = {"host": "node-b", "pid": 4242, "start": "2026-12-01T10:00:00+0000", "heartbeat": time.time() - age_s,
           "heartbeat_s": 15.0, **extra}
    # in place, as a holder's heartbeat writes it (one pwrite, no truncation): a heartbeat thread of this
    # process reading the file between a truncation and the write would take it for empty and overwrite it
    fd = os.open(run_dir / ".lock", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, json.dumps(rec).ljust(512).encode(), 0)
    finally:
        os.close(fd)


def _until(cond, what, timeout_s=60.0):
    """Wait until ``cond()`` is true (an event of another thread), at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


def test_lock_heartbeat_of_another_host(tmp_path, capsys):
    """NFS case, faked: the lock file names another host. A fresh heartbeat (5 s old) refuses a
    real `zerotron train` (in-process main) with one line naming host, pid and age, leaving the
    file as it was; a stale one (older than LOCK_STALE_S) is taken over with a message; the
    holder's heartbeat thread refreshes the record, and warns (without overwriting) when another
    run's record replaces it."""
    from zerotron.train.run_lock import LOCK_STALE_S, RunLock

    run = tmp_path / "run"
    _foreign_lock(run, 5)
    before = (run / ".lock").read_bytes()
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    m = re.search(r"is locked by pid 4242 on host node-b \(started 2026-12-01T10:00:00\+0000, heartbeat (\d+) s ago\)", err)
    assert m and 5 <= int(m.group(1)) < 60, err
    assert f"wait until its heartbeat is older than {LOCK_STALE_S:g} s" in err, err
    assert (run / ".lock").read_bytes() == before and [p.name for p in run.iterdir()] == [".lock"]
    # a heartbeat from the future (clock skew) counts as fresh
    _foreign_lock(run, -30)
    with pytest.raises(Exception, match="heartbeat 0 s ago"):
        RunLock(run).acquire()
    # stale: taken over with one message, the file now names this process
    _foreign_lock(run, LOCK_STALE_S + 300)
    lock = RunLock(run, heartbeat_s=0.05)
    msg = lock.acquire()
    assert msg and msg.count("\n") == 0, msg
    assert f"taking over the stale lock {run / '.lock'} of pid 4242 on host node-b" in msg, msg
    assert "last heartbeat 7 min ago, more than 120 s" in msg, msg
    rec = json.loads((run / ".lock").read_text())
    assert (rec["host"], rec["pid"]) == (os.uname().nodename, os.getpid())
    first = rec["heartbeat"]
    _until(lambda: json.loads((run / ".lock").read_text())["heartbeat"] > first, "a heartbeat")  # the thread's
    # another run's record replaces ours (two starts racing past a flock that does not cross hosts)
    _foreign_lock(run, 0, pid=777)
    _until(lambda: not lock._thread.is_alive(), "the heartbeat thread noticing pid 777")  # it warns, then ends
    warn = capsys.readouterr().err
    assert "the run lock" in warn and "now names pid 777 on host node-b" in warn, warn
    assert json.loads((run / ".lock").read_text())["pid"] == 777  # not overwritten, not emptied
    lock.release()
    assert json.loads((run / ".lock").read_text())["pid"] == 777
    (run / ".lock").write_bytes(b"")
    lock = RunLock(run, heartbeat_s=0.05)
    assert lock.acquire() is None
    lock.release()
    assert (run / ".lock").read_bytes() == b"" and lock._thread is None


# ---- 3-6. signals, torn metrics line, checksums, full disk (one shared uninterrupted run) ----------

STEPS = 8


def base_args(run_dir, cache):
    return ["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run_dir),
            "--train.steps", str(STEPS), "--model.dropout", "0.1", "--train.micro_batch", "2",
            "--checkpoint.every", "0", "--checkpoint.keep", "0", "--train.eval_every", "4",
            "--data.cache_dir", cache, "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false"]


def metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def load_flat(ckpt_dir, out):
    return checkpoint_flat(ckpt_dir, out)


def assert_same_state(a_dir, b_dir, tmp):
    a, b = load_flat(a_dir, tmp / "a.pt"), load_flat(b_dir, tmp / "b.pt")
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def stop_with(argv, sig, after_step, group, env):
    """Start `zerotron train` (argv), send ``sig`` once metrics.jsonl shows ``after_step`` steps (to
    the launcher, or to its whole process group); returns (returncode, stderr)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    p = subprocess.Popen([sys.executable, "-m", "zerotron", *argv], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = Path(argv[argv.index("--run-dir") + 1])
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        f = run / "metrics.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= after_step:
            break
        time.sleep(0.05)
    (os.killpg if group else os.kill)(p.pid, sig)
    _, err = p.communicate(timeout=240)
    return p.returncode, err


def in_ranks(*args, env=None):
    """``zerotron <args>`` (with ``--nproc N``) run as its N workers on the pooled ranks: for
    reference runs, which do not test the launcher (no N fresh interpreters)."""
    argv = list(args)
    i = argv.index("--nproc")
    world = int(argv[i + 1])
    results = run_ranks_captured(main, world, argv[:i] + argv[i + 2:], env={"OMP_NUM_THREADS": "1", **(env or {})},
                                 join_timeout_s=300)
    assert [code for code, _, _ in results] == [0] * world, results
    return results[0]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("faults")
    in_ranks(*base_args(tmp / "full", data_cache))  # the uninterrupted reference of sections 2 and 7
    return tmp


def test_graceful_stop_and_resume_equal(full_run, data_cache):
    """SIGTERM to the launcher, then SIGINT to the process group of the resumed run: each time every
    rank finishes its step, writes a checkpoint and exits with one line (143, then 130); a torn
    last metrics line and a stale .tmp_step_* do not stop the resume; the final state equals the
    uninterrupted run bitwise."""
    run = full_run / "stopped"
    argv = base_args(run, data_cache)
    slow = {"ZEROTRON_FAULT_STEP_SLEEP_S": "0.4"}
    code, err = stop_with(argv, signal.SIGTERM, 2, group=False, env=slow)
    stops = [ln for ln in ours(err) if "stopped by" in ln]
    assert code == 143 and len(stops) == 1, err
    n = int(stops[0].split("at step ")[1].split(";")[0])
    assert 2 <= n < STEPS and "checkpoint written" in stops[0] and "--resume" in stops[0]
    assert f"--run-dir {run}" in stops[0].split("resume with: ")[1]
    assert [s for s, _ in list_checkpoints(run)] == [n] and len(metrics(run)) == n
    # faults between the runs: a torn line (disk full while writing), a save killed mid-way
    with open(run / "metrics.jsonl", "a") as f:
        f.write(f'{{"step": {n + 1}, "loss": 3.1')
    (run / "checkpoints" / ".tmp_step_99").mkdir()
    # a re-save of step n killed between its renames: the old step_n set aside, the new one unrenamed
    os.replace(run / "checkpoints" / f"step_{n}", run / "checkpoints" / f".old_step_{n}")
    (run / "checkpoints" / f".tmp_step_{n}").mkdir()
    code, err = stop_with([*argv, "--resume"], signal.SIGINT, n + 2, group=True, env=slow)
    stops = [ln for ln in ours(err) if "stopped by SIGINT" in ln]
    assert code == 130 and len(stops) == 1, err
    assert "dropped the torn last line" in err and "removed" in err and ".tmp_step_99" in err
    assert not (run / "checkpoints" / ".tmp_step_99").exists()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # step n put back
    m = int(stops[0].split("at step ")[1].split(";")[0])
    assert m > n and [s for s, _ in list_checkpoints(run)] == [n, m]
    _, _, err = in_ranks(*argv, "--resume")  # the rest of the run: its workers, on the pooled ranks
    assert "stopped by" not in err
    full = metrics(full_run / "full")
    assert [x["step"] for x in metrics(run)] == list(range(1, STEPS + 1))
    assert [x["loss"] for x in metrics(run)] == [x["loss"] for x in full]
    assert_same_state(full_run / "full" / "checkpoints" / f"step_{STEPS}", run / "checkpoints" / f"step_{STEPS}",
                      full_run)
    strict_load(run / "summary.json")


def test_torn_metrics_line_dropped(tmp_path, capsys):
    from zerotron.train.metrics import MetricsWriter, read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    MetricsWriter(f, resume_step=2).close()
    assert "dropped the torn last line 3" in capsys.readouterr().err
    assert read_metrics(f) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    f.write_text('{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_metrics(f)


def test_hung_peer_in_checkpoint_agreement_is_one_line(single_process, monkeypatch):
    """A peer stopped (SIGSTOP) or dead while the ranks agree on a save's outcome: the waiting rank
    raises the watchdog's one-line CollectiveError naming the collective (was gloo's RuntimeError
    "Application timeout caused pair closure", a traceback of rank 0 after the collective timeout)."""
    import torch.distributed as dist

    from zerotron.distributed.watchdog import CollectiveError
    from zerotron.train.checkpoint import save

    def timed_out(*args, **kwargs):
        raise RuntimeError("Application timeout caused pair closure")

    monkeypatch.setattr(dist, "all_reduce", timed_out)
    with pytest.raises(CollectiveError, match=r"all_reduce \(tag 'checkpoint_agree'\) on group world .*dead or hung "
                                              r"peer\? RuntimeError: Application timeout"):
        save._agree_error(None)


def test_checksum_mismatch(full_run, tmp_path, capsys):
    """A flipped byte (same size: only the checksum sees it): generate and export stop with exit 2
    naming the file; resume falls back to the previous checkpoint (test_cli covers the fallback)."""
    import shutil

    from zerotron.train.checkpoint import verify_checkpoint

    ck = tmp_path / "step_8"
    shutil.copytree(full_run / "full" / "checkpoints" / f"step_{STEPS}", ck)
    verify_checkpoint(ck)
    data = next(ck.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    for argv in (["generate", "--checkpoint", str(ck), "--prompt", "x"],
                 ["export", "--checkpoint", str(ck), "--out", str(tmp_path / "hf")]):
        code, err = main(argv), capsys.readouterr().err
        assert code == 2 and f"file {data.name} does not match its checksum" in err, err
    assert not (tmp_path / "hf").exists()


def test_edited_meta_json_is_damage(tmp_path, data_cache, capsys):
    """meta.json is covered by the integrity check (issue 35): an edited step or tokens_seen, a
    step that disagrees with its step_<N> directory, and a torn or missing meta.json each mark the checkpoint damaged
    -- generate refuses in one line (exit 2), --resume moves it aside and falls back to the
    previous checkpoint, which then trains steps 3 and 4 to exactly the losses of the first run."""
    import shutil

    from zerotron.train.checkpoint import verify_checkpoint
    from zerotron.train.checkpoint.integrity import META_CHECKSUM, meta_checksum

    run = tmp_path / "run"
    argv = ["train", "--config", "configs/tiny.toml", "--run-dir", str(run), "--train.steps", "4",
            "--checkpoint.every", "2", "--checkpoint.keep", "0", "--train.eval_every", "0",
            "--data.cache_dir", data_cache, "--log.progress", "false", "--log.sample_tokens", "0",
            "--log.plot", "false"]
    assert main(argv) == 0
    first = metrics(run)
    ck = run / "checkpoints" / "step_4"
    meta = json.loads((ck / "meta.json").read_text())
    assert meta[META_CHECKSUM].startswith("sha256:")
    capsys.readouterr()
    def sealed(**changes):  # consistent in itself (a re-computed meta_checksum), wrong otherwise
        m = {**meta, **changes}
        m[META_CHECKSUM] = meta_checksum(m)
        return m
    resealed = sealed(step=5)
    cases = {"step": ({**meta, "step": 5}, "meta.json does not match its own meta_checksum"),
             "resealed": (resealed, "meta.json says step 5 in directory step_4"),
             "tokens": ({**meta, "tokens_seen": meta["tokens_seen"] + 1}, "meta.json does not match its own meta_checksum"),
             "torn": (None, "meta.json is unreadable"),
             "float-step": (sealed(step=4.0), "meta.json says step 4.0 in directory step_4"),
             "checksums-list": (sealed(checksums=[]), "meta.json's checksums is not a JSON object"),
             # without the model's shape (keys lost, meta_checksum re-sealed): was generate's KeyError traceback
             "no-model-config": (sealed(model_config=None), "meta.json has no model_config"),
             "missing": (False, "meta.json is missing"),  # was: --resume refused, "not a zerotron checkpoint"
             # an empty step_4 (a copy that never arrived): was the same refusal, for --resume and for
             # generate / export of the run directory
             "emptied": (False, "meta.json is missing and so is DCP's .metadata")}
    for name, (edited, why) in cases.items():
        bad = tmp_path / name
        shutil.copytree(run, bad)
        text = json.dumps(edited, indent=1) if edited else (ck / "meta.json").read_text()[:200]
        (bad / "checkpoints" / "step_4" / "meta.json").write_text(text)
        if edited is False:
            for f in (bad / "checkpoints" / "step_4").rglob("*") if name == "emptied" else ():
                if f.is_file():
                    f.unlink()
            (bad / "checkpoints" / "step_4" / "meta.json").unlink(missing_ok=True)
            code, err = main(["generate", "--checkpoint", str(bad), "--prompt", "x"]), capsys.readouterr().err
            assert code == 2 and len(err.strip().splitlines()) == 1 and why in err and "to resume from step_2" in err, err
        with pytest.raises(Exception, match=why):
            verify_checkpoint(bad / "checkpoints" / "step_4")
        code, err = main(["generate", "--checkpoint", str(bad / "checkpoints" / "step_4"), "--prompt", "x"]), \
            capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and (why if edited is not False else
                                                                     "no checkpoint found") in err, err
        code = main([*argv[:4], str(bad), *argv[5:], "--resume", "--train.steps", "4"])
        err = capsys.readouterr().err
        assert code == 0, err
        assert f"step_4 is damaged ({why}" in err and "falling back to step_2" in err, err
        assert (bad / "checkpoints" / "damaged_step_4").is_dir()
        assert [x["loss"] for x in metrics(bad)] == [x["loss"] for x in first], name
        verify_checkpoint(bad / "checkpoints" / "step_4")  # the new save verifies
    # a checkpoint saved before meta_checksum existed has none and still passes
    old = tmp_path / "old"
    shutil.copytree(ck, old / "checkpoints" / "step_4")
    (old / "checkpoints" / "step_4" / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != META_CHECKSUM}))
    verify_checkpoint(old / "checkpoints" / "step_4")


def test_resume_with_another_model_setting_refused(full_run, data_cache, tmp_path):
    """Issue 13 item 7: a resume whose model settings differ in anything but the sizes (here the
    biases) is refused before any worker starts, with one line naming the field, and the run
    directory is left as it was; the same check passes a Llama checkpoint resumed as saved and
    refuses it with another rope_theta (check_resume in this process)."""
    import shutil

    from zerotron.config import ConfigError
    from zerotron.train.setup import check_resume

    run = tmp_path / "run"
    shutil.copytree(full_run / "full", run)
    def files():  # all but the lock file (taken and released by the refused run)
        return sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*") if p.name != ".lock")
    before = files()
    r = cli(*base_args(run, data_cache), "--model.bias", "false", "--resume", check=2)
    assert ours(r.stderr) == [r.stderr.strip()] and "bias True (checkpoint) vs False (now)" in r.stderr, r.stderr
    assert files() == before
    lrun = tmp_path / "llama"
    cli("train", "--config", "configs/llama_tiny.toml", "--run-dir", str(lrun), "--train.steps", "1",
        "--data.cache_dir", data_cache, *[x for kv in QUIET.items() for x in ("--" + kv[0], kv[1])], check=0)
    cfg = tiny_config({"data.cache_dir": data_cache}, path=ROOT / "configs" / "llama_tiny.toml")
    assert check_resume(cfg, lrun, quarantine=False).name == "step_1"
    cfg = tiny_config({"data.cache_dir": data_cache, "model.rope_theta": 500000.0},
                      path=ROOT / "configs" / "llama_tiny.toml")
    with pytest.raises(ConfigError, match=r"rope_theta 10000.0 \(checkpoint\) vs 500000.0 \(now\)"):
        check_resume(cfg, lrun, quarantine=False)


def test_disk_full_during_save(full_run, data_cache):
    """ENOSPC on rank 1 while writing step 4, checkpoint.on_error = stop: one line naming the
    partial directory, which is removed; the previous checkpoint (step 2) is kept; exit 3. An
    unknown on_error value is refused at validation."""
    run = full_run / "enospc"
    r = cli(*base_args(run, data_cache), "--checkpoint.every", "2", "--checkpoint.keep", "1",
            "--checkpoint.on_error", "stop",
            env={"ZEROTRON_FAULT_SAVE_ENOSPC_AT_STEP": "4", "ZEROTRON_FAULT_SAVE_RANK": "1"}, check=3)
    lines = [ln for ln in ours(r.stderr) if "cannot write checkpoint" in ln]
    assert len(lines) == 1 and ".tmp_step_4" in lines[0] and "No space left on device" in lines[0], r.stderr
    assert "step_2 is kept; stopped: checkpoint.on_error = stop; the last 2 steps are not saved" in lines[0]
    assert [s for s, _ in list_checkpoints(run)] == [2] and not (run / "checkpoints" / ".tmp_step_4").exists()
    assert len(metrics(run)) == 4
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(full_run / "x"),
                 "--checkpoint.on_error", "retry"])
    assert code == 2 and not (full_run / "x").exists()


def test_space_check_refuses_before_writing_and_continue(tmp_path, data_cache, single_process, monkeypatch, capsys,
                                                          report):
    """The free-space check, with the filesystem's free bytes faked low at steps 1 and 3 of 4
    (checkpoint.every 1, on_error = continue, the default): those saves write nothing at all (DCP is
    not called, no .tmp_step_N is made) and say so in one line with the path, the bytes free and
    the bytes needed (the first save: the state-dict estimate; later: the previous checkpoint's
    size on disk); training goes on and the saves of steps 2 and 4 succeed. With save_final =
    false a run whose last save failed ends with exit 3 (nothing saved after it)."""
    import torch.distributed.checkpoint as dcp

    from zerotron.train.checkpoint import files, space, verify_checkpoint
    from zerotron.train.lifecycle import RunStopped
    from zerotron.train.trainer import Trainer

    full_at, written, made = {1, 3}, [], []
    real_free, real_save, real_mkdir = space.free_bytes, dcp.save, Path.mkdir
    step_now = {"n": 0}
    monkeypatch.setattr(space, "free_bytes", lambda root: 1000 if step_now["n"] in full_at else real_free(root))
    monkeypatch.setattr(dcp, "save", lambda sd, checkpoint_id: (written.append(Path(checkpoint_id).name),
                                                                    real_save(sd, checkpoint_id=checkpoint_id)))
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: (made.append(self.name), real_mkdir(self, *a, **k))[1])
    cfg = tiny_config({**QUIET, "train.steps": 4, "train.eval_every": 0, "data.cache_dir": data_cache,
                       "checkpoint.every": 1, "checkpoint.keep": 0})
    tr = Trainer(cfg, tmp_path / "run")
    summary = tr.fit(callback=lambda t, rec: step_now.update(n=rec["step"]))  # called before the step's save
    err = capsys.readouterr().err
    lines = [ln for ln in ours(err) if "not writing checkpoint" in ln]
    root = tmp_path / "run" / "checkpoints"
    assert len(lines) == 2, err
    est = tr.expected_checkpoint_bytes()
    assert lines[0] == (f"zerotron: warning: not writing checkpoint step_1: no space left on device: {root} has 1,000 "
                        f"bytes free, the checkpoint needs about {est:,} bytes (estimated from the parameter and "
                        "optimizer-state bytes); nothing was written; there is no earlier checkpoint; training "
                        "continues (checkpoint.on_error = continue), the next save at step 2 retries"), lines[0]
    need = int(lines[1].split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert need == files.dir_disk_bytes(root / "step_2") >= files.dir_bytes(root / "step_2") and "(the size of step_2)" in lines[1]
    assert f"the newest checkpoint {root / 'step_2'} is kept" in lines[1] and "next save at step 4 retries" in lines[1]
    assert written == [".tmp_step_2", ".tmp_step_4"] and ".tmp_step_1" not in made and ".tmp_step_3" not in made
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2, 4] and summary["failed_checkpoints"] == [1, 3]
    verify_checkpoint(root / "step_2")
    real = files.dir_bytes(root / "step_2")
    assert real <= est <= 1.15 * real  # the first-save estimate errs on the safe side, not by much
    report(f"space check: first-save estimate {est:,} bytes, real checkpoint {real:,} bytes "
           f"({files.dir_disk_bytes(root / 'step_2'):,} on disk)")
    # the last save of a run without a final save fails: the run still ends with exit 3
    full_at.clear()
    full_at.add(2)
    step_now["n"] = 0
    cfg = tiny_config({**QUIET, "train.steps": 3, "train.eval_every": 0, "data.cache_dir": data_cache,
                       "checkpoint.every": 2, "checkpoint.save_final": "false"})
    with pytest.raises(RunStopped, match="training finished at step 3, but checkpoint step_2 could not be written "
                       "and no later save was scheduled") as e:
        Trainer(cfg, tmp_path / "run2").fit(callback=lambda t, rec: step_now.update(n=rec["step"]))
    assert e.value.exit_code == 3 and "no later save is scheduled" in capsys.readouterr().err


def _enospc_on(monkeypatch, marker: bytes, times: int):
    """Make the first ``times`` os.write calls whose data holds ``marker`` write a few bytes, then
    fail with ENOSPC (a disk that fills in the middle of a metrics line). Returns the call log."""
    import errno

    real, log = os.write, []

    def write(fd, data):
        if marker in bytes(data) and len(log) < times:
            log.append(len(data))
            real(fd, bytes(data)[:7])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)
    return log


def test_metrics_append_failure_leaves_whole_lines(tmp_path, monkeypatch):
    """A failed append is cut back (no torn line); the records are held and written, in order,
    with the next append that succeeds; close() reports what it could not write."""
    from zerotron.train.metrics import MetricsWriteError, MetricsWriter

    f = tmp_path / "metrics.jsonl"
    w = MetricsWriter(f)
    w.write({"step": 1, "loss": 2.0})
    whole = f.read_bytes()
    log = _enospc_on(monkeypatch, b'"step": 2', 2)
    with pytest.raises(MetricsWriteError, match=f"cannot append step 2 to {f}: No space left on device"):
        w.write({"step": 2, "loss": 1.5})
    assert f.read_bytes() == whole and w.held_steps == [2]
    with pytest.raises(MetricsWriteError, match="cannot append steps 2-3 to") as e:
        w.write({"step": 3, "loss": float("nan")})
    assert e.value.errno == 28 and f.read_bytes() == whole and len(log) == 2
    w.write({"step": 4, "loss": 1.0})
    w.close()
    assert [json.loads(ln) for ln in f.read_text().splitlines()] == [
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": None}, {"step": 4, "loss": 1.0}]
    # a resume cuts the file in place (no new space needed) back to the checkpoint's step
    before = f.stat().st_ino
    MetricsWriter(f, resume_step=2).close()
    assert f.read_bytes() == whole + b'{"step": 2, "loss": 1.5}\n' and f.stat().st_ino == before


@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_metrics_disk_full_policy(on_error, tmp_path, data_cache, monkeypatch, capsys):
    """metrics.jsonl appends of steps 3 and 4 fail (ENOSPC mid-line), the next one succeeds.
    continue: one warning, one note, training goes on, every record lands in order, exit 0.
    stop: every rank agrees at step 4, checkpoint step_4 is written, the held records land, one
    line names the error and the resume command, exit 3, summary.json says why; the resume then
    trains exactly like the uninterrupted run."""
    common = ["train", "--config", "configs/tiny.toml", "--train.steps", "6", "--checkpoint.every", "0",
              "--train.eval_every", "0", "--data.cache_dir", data_cache, "--log.progress", "false",
              "--log.sample_tokens", "0", "--log.plot", "false", "--checkpoint.on_error", on_error]
    ref = tmp_path / "ref"
    assert main([*common, "--run-dir", str(ref)]) == 0
    run = tmp_path / "run"
    capsys.readouterr()
    log = _enospc_on(monkeypatch, b'"step": 3, "loss"', 2)
    code = main([*common, "--run-dir", str(run)])
    err = capsys.readouterr().err
    monkeypatch.undo()
    lines = [ln for ln in ours(err) if "metrics" in ln]
    raw = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(ln) for ln in raw]  # every line whole
    summary = strict_load(run / "summary.json")
    assert len(log) == 2
    if on_error == "continue":
        assert code == 0 and len(lines) == 2, err
        assert lines[0].startswith(f"zerotron: warning: cannot append step 3 to {run / 'metrics.jsonl'}: No space "
                                   "left on device; training continues (checkpoint.on_error = continue)"), lines
        assert lines[1] == ("zerotron: metrics.jsonl is written again at step 5 (the records of steps 3-4 had been "
                            "held in memory)"), lines
        assert [r["step"] for r in records] == list(range(1, 7)) and "stopped" not in summary
        assert [r["loss"] for r in records] == [r["loss"] for r in metrics(ref)]
        return
    assert code == 3 and len(lines) == 1, err
    assert lines[0].startswith(f"zerotron: cannot append steps 3-4 to {run / 'metrics.jsonl'}: No space left on "
                               "device; stopped at step 4 (checkpoint.on_error = stop), checkpoint written ("), lines
    assert "resume with: " in lines[0] and "are not in metrics.jsonl" not in lines[0], lines
    assert [r["step"] for r in records] == [1, 2, 3, 4] and [s for s, _ in list_checkpoints(run)] == [4]
    assert summary["steps"] == 4 and summary["exit_code"] == 3 and summary["stopped"] == lines[0].removeprefix(
        "zerotron: ")
    assert main([*common, "--run-dir", str(run), "--resume"]) == 0
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(ref)]


# ---- 7. automatic restart after a dead worker ------------------------------------------------------

def test_restart_after_kill9_equals_uninterrupted(full_run, data_cache):
    """`--max-restarts 2`: rank 1 kill -9s itself after step 1 (no checkpoint yet: the restarted
    workers start again from step 0, replacing the dead attempt's metrics) and, in the second
    attempt, after step 5 (the third attempt resumes from step_4 without --resume). One line per
    restart names the dead worker and the step; the final state equals the uninterrupted run."""
    run = full_run / "restarted"
    t0 = time.monotonic()
    r = cli(*base_args(run, data_cache), "--checkpoint.every", "2", "--max-restarts", "2",
            env={"ZEROTRON_FAULT_KILL_AT_STEP": "1,5", "ZEROTRON_FAULT_KILL_RANK": "1"}, check=0)
    took = time.monotonic() - t0
    died = "zerotron: worker 1 died (killed by SIGKILL: possibly out of memory (check dmesg)); "
    assert [ln for ln in ours(r.stderr) if "; restart " in ln] == [
        died + "restart 1 of 2: no checkpoint yet, the workers start again from step 0",
        died + f"restart 2 of 2: the workers resume from step 4 ({run / 'checkpoints' / 'step_4'})"], r.stderr
    assert f"zerotron: restart 2: resumed from {run / 'checkpoints' / 'step_4'} (step 4)" in r.stdout
    full = metrics(full_run / "full")
    assert [x["step"] for x in metrics(run)] == list(range(1, STEPS + 1))
    assert [x["loss"] for x in metrics(run)] == [x["loss"] for x in full]
    assert [x.get("val_loss") for x in metrics(run)] == [x.get("val_loss") for x in full]
    assert [s for s, _ in list_checkpoints(run)] == [2, 4, 6, 8]
    assert_same_state(full_run / "full" / "checkpoints" / f"step_{STEPS}", run / "checkpoints" / f"step_{STEPS}",
                      full_run)
    assert (run / ".lock").read_bytes() == b""  # released by the launcher, which held it throughout
    # a survivor stopped by the agent for the restart never claims a user's SIGTERM stop
    assert not [ln for ln in ours(r.stderr) if "SIGTERM" in ln or "finishing the current step" in ln], r.stderr
    print(f"restart test: 2 restarts, {took:.1f} s for the whole run")


def test_restart_note_written_before_survivors_are_stopped(tmp_path, monkeypatch):
    """launch_agent.restart_hooks with fake agent methods (no process): when a worker failed and a
    restart follows, the one-line failure is in the note file before the agent stops the survivors
    (``_monitor_workers`` returns), and gone before the new workers start; no note when the failure
    is not restarted (restarts used up, or a worker stopped on purpose: exit 3)."""
    from types import SimpleNamespace as NS

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from zerotron.launch_agent import restart_hooks

    note, started, said = tmp_path / "note", [], []
    failures = {"now": {0: NS(exitcode=1, timestamp=10), 1: NS(exitcode=-signal.SIGKILL, timestamp=10)}}
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers",
                        lambda self, wg: NS(is_failed=lambda: True, failures=failures["now"]), raising=False)
    monkeypatch.setattr(LocalElasticAgent, "_initialize_workers", lambda self, wg: started.append(note.exists()),
                        raising=False)
    group = NS(spec=NS(max_restarts=2))
    with restart_hooks(lambda failure, count, limit: said.append((failure, count, limit)), note):
        agent = NS(_remaining_restarts=2)
        LocalElasticAgent._monitor_workers(agent, group)
        assert note.read_text() == "worker 1 died (killed by SIGKILL: possibly out of memory (check dmesg))"
        agent._remaining_restarts = 1  # the agent counts the restart, stops the survivors, then starts anew
        LocalElasticAgent._initialize_workers(agent, group)
        assert started == [False] and not note.exists()
        assert said == [("worker 1 died (killed by SIGKILL: possibly out of memory (check dmesg))", 1, 2)]
        agent._remaining_restarts = 0  # restarts used up: the failure ends the run, no note
        LocalElasticAgent._monitor_workers(agent, group)
        assert not note.exists()
        agent._remaining_restarts = 1
        failures["now"] = {0: NS(exitcode=3, timestamp=10), 1: NS(exitcode=-signal.SIGTERM, timestamp=11)}
        LocalElasticAgent._monitor_workers(agent, group)  # a guard stop (exit 3) is not restarted
        assert agent._remaining_restarts == 0 and not note.exists()


def test_restart_note_written_before_torchs_own_stop(tmp_path, monkeypatch):
    """torch's SubprocessContext._poll stops the survivors (PContext.close: SIGTERM) as soon as it
    sees a failed worker, INSIDE _monitor_workers: restart_hooks puts the note on disk before that
    close, so a survivor's SIGTERM handler finds it (the kill -9 restart test printed a user's
    "SIGTERM: finishing the current step" when it lost this race)."""
    from types import SimpleNamespace as NS

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    from zerotron.launch_agent import restart_hooks

    note, at_close = tmp_path / "note", []
    monkeypatch.setattr(PContext, "close", lambda pc, *a, **k: at_close.append(note.read_text() if note.exists() else None))
    stand_in = PContext.close
    pc = NS(_failures={1: NS(exitcode=-signal.SIGKILL, timestamp=10)})  # local rank 1 = global rank 3

    def monitor(self, wg):  # what the real one does: _poll closes the context on a failure, then returns it
        PContext.close(pc)
        return NS(is_failed=lambda: True, failures={3: pc._failures[1], 2: NS(exitcode=-signal.SIGTERM, timestamp=11)})
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", monitor, raising=False)
    group = NS(spec=NS(max_restarts=1), workers=[NS(local_rank=0, global_rank=2), NS(local_rank=1, global_rank=3)])
    with restart_hooks(None, note):
        agent = NS(_remaining_restarts=1)
        LocalElasticAgent._monitor_workers(agent, group)
        assert at_close == ["worker 3 died (killed by SIGKILL: possibly out of memory (check dmesg))"]
        assert agent._remaining_restarts == 1  # the survivor killed by that SIGTERM (-15) does not cancel it
        note.unlink()
        LocalElasticAgent._monitor_workers(NS(_remaining_restarts=0), group)  # no restart follows: no note
        assert at_close[1:] == [None] and not note.exists()
    assert PContext.close is stand_in  # restored on exit


_SURVIVOR = """
import os, pathlib, signal, sys
from zerotron.train.lifecycle import GracefulStop
stop = GracefulStop(grace_s=30, announce=True)
stop.install()
os.kill(os.getpid(), signal.SIGTERM)  # no note: a user's stop (only recorded; the loop would finish its step)
print("pending", stop.pending, flush=True)
pathlib.Path(os.environ["ZEROTRON_RESTART_NOTE"]).write_text(sys.argv[1] + "\\n")
os.kill(os.getpid(), signal.SIGTERM)  # the launcher's stop for a restart: exits here
print("still running", flush=True)
"""


def test_survivor_stopped_for_restart_says_so(tmp_path):
    """The SIGTERM by which the --max-restarts launcher stops a surviving worker (the note file
    names the dead worker): one line saying it is stopped for a restart after that worker died, and
    it dies by that SIGTERM at once (no step or checkpoint can complete with a dead peer; exit -15,
    not 143, which the launcher reads as a stop on purpose and does not restart). Before the note exists
    the same SIGTERM is a user's graceful stop: the usual notice, and the process goes on."""
    note = "worker 1 died (killed by SIGKILL: possibly out of memory (check dmesg))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZEROTRON_RESTART_NOTE": str(tmp_path / "note")}
    r = subprocess.run([sys.executable, "-c", _SURVIVOR, note], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -signal.SIGTERM and r.stdout == f"pending {int(signal.SIGTERM)}\n", (r.stdout, r.stderr)
    assert ours(r.stderr) == [
        "zerotron: SIGTERM: finishing the current step, then writing a checkpoint (at most 30 s; a second signal "
        "exits at once)",
        f"zerotron: stopped for a restart after {note}: exiting at once, without a checkpoint (the launcher starts "
        "the workers again)"], r.stderr


def test_max_restarts_refused_without_nproc(capsys, tmp_path):
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--max-restarts", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-restarts restarts the worker processes of --nproc" in err, err
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--nproc", "2",
                 "--max-restarts", "-1"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-restarts must be >= 0, got -1" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


# ---- 8. a real full disk: a small tmpfs in a user + mount namespace --------------------------------

def _in_tmpfs(tmp_path, size: str, train_args: list[str], before: str = "", during: str = "", env=None):
    """Run `zerotron train <train_args> --run-dir <tmpfs>/run` in a user + mount namespace on a
    fresh tmpfs of ``size`` (``unshare -rm``; skips with a printed reason where that is not
    permitted). ``before``: shell run after the mount; ``during``: shell run while training runs
    in the background ($ERR is its stderr file). The tmpfs exists only inside the namespace, so
    the run directory is copied out before leaving. Returns (exit code, stderr, copied run dir)."""
    import shlex
    import shutil

    if not shutil.which("unshare"):
        print("SKIPPED: no unshare(1) to mount a tmpfs")
        pytest.skip("no unshare(1) to mount a tmpfs")
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = disk / "run"
    train = [sys.executable, "-m", "zerotron", "train", "--config", "configs/tiny.toml", "--run-dir", str(run),
             "--train.eval_every", "0", "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false",
             *train_args]
    q = shlex.quote
    script = (f"mount -t tmpfs -o size={size} tmpfs {q(str(disk))} || exit 77; DISK={q(str(disk))}; "
              f"ERR={q(str(out / 'err'))}; RC={q(str(out / 'rc'))}; : > $ERR; {before or ':'}; "
              f"( {shlex.join(train)} 2> $ERR; echo $? > $RC.tmp; mv $RC.tmp $RC ) & {during or ':'}; wait; "
              f"cp -a {q(str(run))} {q(str(out))}/")
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=300, check=False)
    if r.returncode == 77 or (r.returncode and not (out / "rc").exists()):
        why = f"cannot mount a tmpfs here (unshare -rm: {(r.stderr.strip().splitlines() or ['?'])[-1]})"
        print(f"SKIPPED: {why}")
        pytest.skip(why)
    return int((out / "rc").read_text()), (out / "err").read_text(), out / "run"


def test_disk_full_on_real_tmpfs(tmp_path, data_cache):
    """A 5 MiB tmpfs holds one checkpoint of the tiny model (3.4 MB) but not two. With the
    free-space check switched off (ZEROTRON_FAULT_NO_SPACE_CHECK: as if another writer filled
    the disk after it), the final save of step 4 fails with a real ENOSPC (torch.save says only
    "unexpected pos ..."). One line names the path, the bytes free and needed; the partial
    .tmp_step_4 is gone; step_2 is intact (its checksums verify); the failed *final* save exits 3
    although checkpoint.on_error = continue (the default)."""
    from zerotron.train.checkpoint import verify_checkpoint
    from zerotron.train.checkpoint.files import dir_disk_bytes

    code, err, out_run = _in_tmpfs(tmp_path, "5M", ["--train.steps", "4", "--checkpoint.every", "2",
                                                    "--checkpoint.keep", "1", "--data.cache_dir", data_cache],
                                   env={"ZEROTRON_FAULT_NO_SPACE_CHECK": "1"})
    run = tmp_path / "disk" / "run"
    assert code == 3, err
    lines = [ln for ln in ours(err) if "cannot write checkpoint" in ln]
    assert len(lines) == 1, err
    line, kept = lines[0], out_run / "checkpoints" / "step_2"
    assert f"cannot write checkpoint {run / 'checkpoints' / '.tmp_step_4'} (" in line, line
    assert f"no space left on device: {run / 'checkpoints'} has " in line and " bytes free" in line, line
    need = int(line.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert need == dir_disk_bytes(kept) and "(the size of step_2)" in line, line
    assert f"the newest checkpoint {run / 'checkpoints' / 'step_2'} is kept" in line, line
    assert "stopped: the final checkpoint (step 4 of 4) could not be written; the last 2 steps are not saved" in line
    assert line.endswith("--resume"), line
    assert sorted(p.name for p in (out_run / "checkpoints").iterdir()) == ["step_2"]
    verify_checkpoint(kept)  # files present, sizes and SHA-256 as recorded
    assert [x["step"] for x in metrics(out_run)] == [1, 2, 3, 4]
    summary = strict_load(out_run / "summary.json")  # written although the run stopped (issue 35)
    assert summary["failed_checkpoints"] == [4] and summary["exit_code"] == 3 and summary["steps"] == 4
    assert summary["stopped"] == line.removeprefix("zerotron: "), summary


def test_disk_full_then_freed_on_real_tmpfs(tmp_path, data_cache):
    """An 8 MiB tmpfs, 3 MiB of it taken by another file: step_2 fits, then the free-space check
    refuses step 4 before writing anything (one line: path, bytes free < bytes needed = step_2's
    size on disk); with checkpoint.on_error = continue (the default) training goes on. The other
    file is deleted meanwhile, so the save of step 6 succeeds; step_2 is intact; exit 0."""
    from zerotron.train.checkpoint import verify_checkpoint
    from zerotron.train.checkpoint.files import dir_disk_bytes

    code, err, out_run = _in_tmpfs(
        tmp_path, "8M", ["--train.steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "2",
                         "--data.cache_dir", data_cache],
        before="head -c 3145728 /dev/zero > $DISK/filler",
        during='while [ ! -e "$RC" ] && ! grep -q "not writing checkpoint step_4" "$ERR"; do sleep 0.05; done; '
               f'rm -f $DISK/filler; touch {tmp_path / "freed"}',
        env={"ZEROTRON_FAULT_GATE": f"4:{tmp_path / 'freed'}"})  # step 5 waits for the watcher: no margin of sleeps
    run = tmp_path / "disk" / "run"
    assert code == 0, err
    lines = [ln for ln in ours(err) if "checkpoint" in ln and ("warning" in ln or "error" in ln)]
    assert len(lines) == 1, err
    line = lines[0]
    m = re.search(r"has ([\d,]+) bytes free, the checkpoint needs about ([\d,]+) bytes \(the size of step_2\)", line)
    assert line.startswith("zerotron: warning: not writing checkpoint step_4: no space left on device: "
                           f"{run / 'checkpoints'} has ") and m, line
    free, need = (int(g.replace(",", "")) for g in m.groups())
    assert free < need == dir_disk_bytes(out_run / "checkpoints" / "step_2"), line
    assert "nothing was written" in line and "training continues (checkpoint.on_error = continue), the next save at " \
        "step 6 retries" in line, line
    assert sorted(p.name for p in (out_run / "checkpoints").iterdir()) == ["step_2", "step_6"]
    for s in (2, 6):
        verify_checkpoint(out_run / "checkpoints" / f"step_{s}")
    assert [x["step"] for x in metrics(out_run)] == list(range(1, 7))
    assert strict_load(out_run / "summary.json")["failed_checkpoints"] == [4]


def _wait_lines(n: int) -> str:
    """Shell: wait until $DISK/run/metrics.jsonl has n lines (or the run ended)."""
    return (f'while [ ! -e "$RC" ] && [ "$(cat $DISK/run/metrics.jsonl 2>/dev/null | wc -l)" -lt {n} ]; '
            "do sleep 0.05; done")


FILL = "dd if=/dev/zero of=$DISK/filler bs=64k 2>/dev/null || true"


def test_metrics_disk_full_then_freed_on_real_tmpfs(tmp_path, data_cache):
    """A 20 MiB tmpfs filled with dd after step_4 exists (issue 35): the metrics.jsonl append that
    meets the full disk leaves no torn line; one warning, training goes on (checkpoint.on_error =
    continue), the save of step 4 is refused by the space check; once the filler is deleted the
    held records are written, in order, with one note; step 16 is saved; exit 0."""
    code, err, out_run = _in_tmpfs(
        tmp_path, "20M", ["--train.steps", "16", "--checkpoint.every", "4", "--checkpoint.keep", "1",
                          "--data.cache_dir", data_cache],
        during=f"while [ ! -e $DISK/run/checkpoints/step_4 ] && [ ! -e \"$RC\" ]; do sleep 0.05; done; {FILL}; "
               f"touch {tmp_path / 'full'}; "
               'while [ ! -e "$RC" ] && ! grep -q "cannot append" "$ERR"; do sleep 0.05; done; rm -f $DISK/filler; '
               f"touch {tmp_path / 'freed'}",
        # the run waits after step 4 for the disk to be full and after step 15 for it to be freed
        env={"ZEROTRON_FAULT_GATE": f"4:{tmp_path / 'full'},15:{tmp_path / 'freed'}"})
    assert code == 0, err
    warn = [ln for ln in ours(err) if "cannot append" in ln]
    note = [ln for ln in ours(err) if "is written again" in ln]
    assert len(warn) == 1 and len(note) == 1, err
    assert "No space left on device; training continues (checkpoint.on_error = continue)" in warn[0], warn
    raw = (out_run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in raw] == list(range(1, 17))  # whole lines, none lost
    assert sorted(p.name for p in (out_run / "checkpoints").iterdir()) == ["step_16"]


def test_metrics_disk_full_stop_then_resume_on_real_tmpfs(tmp_path, data_cache):
    """Two ranks, checkpoint.on_error = stop, a 20 MiB tmpfs filled with dd after the run resumed
    from step_2 wrote a line, never freed: the first failed append is agreed by both ranks at the next step, the
    checkpoint attempt is refused by the space check, one line names both and the resume command,
    exit 3; metrics.jsonl holds whole lines only. Resumed on a disk with room, the run ends exactly
    like the uninterrupted two-rank run."""
    import shlex
    import shutil

    args = ["--nproc", "2", "--checkpoint.every", "0", "--checkpoint.keep", "1", "--checkpoint.on_error", "stop",
            "--data.cache_dir", data_cache, "--train.eval_every", "0", "--log.progress", "false",
            "--log.sample_tokens", "0", "--log.plot", "false"]
    # the uninterrupted two-rank reference first; it also saves step_2, from which a copy of its run
    # directory (metrics cut to 2 lines) stands in for a 2-step run (one 3-process launch fewer)
    ref = tmp_path / "ref"
    train = ["train", "--config", "configs/tiny.toml", "--train.steps", "12", *args]
    in_ranks(*train, "--run-dir", str(ref), "--checkpoint.every", "2", "--checkpoint.keep", "0")
    seed = tmp_path / "seed"
    shutil.copytree(ref, seed, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != "step_2"])
    lines = (seed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (seed / "metrics.jsonl").write_text("".join(lines[:2]))
    assert [s for s, _ in list_checkpoints(seed)] == [2] and [json.loads(ln)["step"] for ln in lines[:2]] == [1, 2]
    code, err, out_run = _in_tmpfs(
        tmp_path, "20M", ["--resume", "--train.steps", "12", *args],
        before=f"cp -a {shlex.quote(str(seed))} $DISK/run",
        during=f"{_wait_lines(3)}; {FILL}; touch {tmp_path / 'full'}",
        env={"ZEROTRON_FAULT_GATE": f"3:{tmp_path / 'full'}"})  # step 4 waits for the full disk
    assert code == 3, err
    lines = [ln for ln in ours(err) if "metrics" in ln or "checkpoint" in ln]
    stop = [ln for ln in lines if "stopped" in ln]
    assert len(stop) == 1, err
    assert "cannot append step" in stop[0] and "No space left on device (checkpoint.on_error = stop)" in stop[0], stop
    assert "not writing checkpoint step_" in stop[0] and "--resume" in stop[0].split("resume with: ")[1], stop
    raw = (out_run / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(ln)["step"] for ln in raw]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 12
    assert [s for s, _ in list_checkpoints(out_run)] == [2]
    in_ranks(*train, "--run-dir", str(out_run), "--resume")
    assert [x["loss"] for x in metrics(out_run)] == [x["loss"] for x in metrics(ref)]


def test_full_disk_at_resume_start_on_real_tmpfs(tmp_path, data_cache):
    """A run resumed on a disk that filled up meanwhile cannot even write its run lock: one
    line naming the lock file and the fix, exit 2, the checkpoint untouched."""
    import shlex

    first = [sys.executable, "-m", "zerotron", "train", "--config", "configs/tiny.toml", "--run-dir", "$DISK/run",
             "--train.steps", "2", "--train.eval_every", "0", "--data.cache_dir", data_cache, "--log.progress",
             "false", "--log.sample_tokens", "0", "--log.plot", "false"]
    code, err, out_run = _in_tmpfs(tmp_path, "8M", ["--resume", "--train.steps", "4", "--data.cache_dir", data_cache],
                                   before=shlex.join(first).replace("'$DISK/run'", "$DISK/run") + f" 2>/dev/null; {FILL}")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == (f"zerotron: error: cannot write the run lock {tmp_path / 'disk' / 'run' / '.lock'}: No space "
                        "left on device; free space on that filesystem (or make it writable), then run again"), lines
    from zerotron.train.checkpoint import verify_checkpoint

    verify_checkpoint(out_run / "checkpoints" / "step_2")



def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the SigCgt mask of /proc/PID/status)."""
    try:
        line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)


def test_sigterm_before_the_first_step_says_nothing_was_saved(tmp_path):
    """SIGTERM while `zerotron train` is still starting (importing torch, building the model): exit
    143 with one line saying it stopped before the first step and saved nothing (it used to die by
    the signal without a word), and the run directory stays startable (no metrics, no checkpoint).
    The signal goes as soon as the process has a SIGTERM handler: seconds before step 1."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "zerotron", "train", "--config", "configs/tiny.toml", "--run-dir",
                          str(run)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the handler comes after `import torch` (seconds, many more on a loaded machine): wait for it
        # itself, not a fixed 600 polls (a signal sent before it kills the process without a word)
        deadline = time.monotonic() + 240
        while not _catches(p.pid, signal.SIGTERM):
            assert p.poll() is None and time.monotonic() < deadline, ("no SIGTERM handler", p.poll())
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err)
    assert ours(err) == ["zerotron: SIGTERM before the first training step: stopped; nothing was saved (checkpoints "
                         "already in the run directory are untouched)"], err
    assert "Traceback" not in err and out == "", (out, err)
    assert not (run / "metrics.jsonl").exists() and not list_checkpoints(run)
    # in a library caller (here pytest) the command leaves the process's own handlers as they were
    before = signal.getsignal(signal.SIGINT)
    assert main(["train", "--config", "configs/tiny.toml", "--train.stepz", "1"]) == 2
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_during_the_end_sample_says_training_finished(tmp_path, data_cache, single_process, monkeypatch,
                                                              capsys):
    """SIGTERM while `zerotron train` writes its end-of-run sample (a long log.sample_tokens): it said
    "before the first training step: stopped; nothing was saved" (the start-up handler was back), with
    the final checkpoint on disk. One line saying training finished and its checkpoints are kept."""
    from zerotron.train.trainer import Trainer

    def sample(self, prompt, n):
        signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns
        raise AssertionError("SIGTERM did not stop the sample")

    monkeypatch.setattr(Trainer, "sample", sample)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "run"), "--train.steps", "1",
                     "--train.eval_every", "0", "--data.cache_dir", data_cache, "--log.progress", "false",
                     "--log.plot", "false", "--log.sample_tokens", "8"])
    finally:
        for s, h in saved.items():  # the command ignores the signals while "exiting"; this process goes on
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM and ours(err) == [
        "zerotron: SIGTERM after the last training step (1): stopped before the end-of-run sample and summary.json "
        "were written; training finished and its checkpoints are kept"], err
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1]


# a launcher (`python -c`) that records its workers' pids and signals itself (SIGTERM) at the moment
# WHEN says: "spawn", just after the first worker is started (the second is not yet); "gate", once
# both workers wait at ZEROTRON_FAULT_GATE's gate before their first step (still in start-up)
SIGNALLED_LAUNCHER = r"""
import json, os, signal, sys, threading, time
import torch.distributed.elastic.multiprocessing.api as api
real, handlers = api.get_subprocess_handler, []
def spawn(**kwargs):
    handler = real(**kwargs)
    handlers.append(handler)
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{handler.proc.pid}\n")
    if os.environ["WHEN"] == "spawn" and len(handlers) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return handler
api.get_subprocess_handler = spawn
def at_gate():
    while not all(os.path.exists(f"{os.environ['GATE']}.rank{r}") for r in (0, 1)):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)
if os.environ["WHEN"] == "gate":
    threading.Thread(target=at_gate, daemon=True).start()
from zerotron.cli.main import main
code = main()
print(json.dumps([h.proc.returncode for h in handlers]))
sys.exit(code)
"""


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no such process, or a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.parametrize("when", ["spawn", "gate"])
def test_sigterm_while_the_launcher_starts_is_one_line_and_leaves_no_worker(when, tmp_path, data_cache):
    """SIGTERM to `zerotron train --nproc 2` during start-up, at two moments: while the launcher
    starts its workers ("spawn": one started, not the other), and while both are still starting
    ("gate": waiting before their first step). Exit 143 with one line (the launcher's: the workers
    were stopped before the first step, nothing saved), every worker killed by that SIGTERM (not by
    the agent's SIGKILL 30 s later), none left running once the launcher is gone, the run directory
    without records or checkpoints and startable again (rank 0 may have opened metrics.jsonl: an empty
    one was refused as "a run without a checkpoint"). Before: the "spawn" signal lost the started worker (the agent's
    shutdown stopped no one and the launcher exited, the worker ran on: rank 1 was seen ~30 s after);
    at "gate", rank 0 printed its own stop line beside the launcher's (two lines) and a worker waiting
    in a C++ call could not run its Python handler until the agent's SIGKILL."""
    run, gate, pids = tmp_path / "run", tmp_path / "gate", tmp_path / "pids"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ZEROTRON_FORK_WORKERS": "1",
           "PIDS": str(pids), "WHEN": when, "GATE": str(gate), "ZEROTRON_FAULT_GATE": f"0:{gate}"}
    argv = ["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run), "--data.cache_dir",
            data_cache, "--train.steps", "2", "--train.eval_every", "0", "--log.progress", "false",
            "--log.sample_tokens", "0", "--log.plot", "false"]
    try:
        r = subprocess.run([sys.executable, "-c", SIGNALLED_LAUNCHER, *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=240)
        workers = [int(x) for x in pids.read_text().split()] if pids.exists() else []
        left = [w for w in workers if not _gone(w)]
    finally:
        for w in [int(x) for x in pids.read_text().split()] if pids.exists() else []:
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
    assert not left and len(workers) == 2, (left, workers, r.stderr)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert ours(r.stderr) == [f"zerotron: launching 2 workers, run directory {run}",
                              "zerotron: SIGTERM before the first training step: the 2 workers were stopped; nothing "
                              "was saved (checkpoints already in the run directory are untouched)"], r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [-signal.SIGTERM] * 2, r.stdout
    assert "Traceback" not in r.stderr and not list_checkpoints(run)
    from zerotron.train.setup import check_run_dir

    check_run_dir(run, resume=False)  # startable again: no records (an empty metrics.jsonl was refused)
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""


def test_final_save_failing_with_no_checkpoint_says_how_to_start_again(tmp_path, data_cache, single_process,
                                                                       monkeypatch):
    """The only save of a run (the final one) finds the disk full: the stop line's fix must be one
    the next command accepts. Its metrics.jsonl stays, so the same --run-dir is refused; the line
    says to use a new one or delete this one (it said "start again", which then was refused)."""
    from zerotron.train.checkpoint import space
    from zerotron.train.lifecycle import RunStopped
    from zerotron.train.setup import check_run_dir
    from zerotron.train.trainer import Trainer

    monkeypatch.setattr(space, "free_bytes", lambda root: 1000)
    cfg = tiny_config({**QUIET, "train.steps": 1, "train.eval_every": 0, "data.cache_dir": data_cache})
    with pytest.raises(RunStopped) as e:
        Trainer(cfg, tmp_path / "run").fit()
    assert str(e.value).endswith(f"free disk space, then start again with a new --run-dir (or delete "
                                 f"{str(tmp_path / 'run')!r} first)"), str(e.value)
    with pytest.raises(Exception, match="choose a new --run-dir, or delete"):  # what the same --run-dir meets
        check_run_dir(tmp_path / "run", resume=False)
