"""Fault injection (issue 13, "runs that never lose work"): non-finite steps, a second run on the
same directory, SIGTERM/SIGINT, a torn metrics line, a damaged checkpoint, a full disk. Each test
reproduces the fault and checks: one clear line, nothing lost, resume equal where it applies."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zerotron.cli import main
from zerotron.testing import run_ranks, tiny_config
from zerotron.train.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0"}


def strict_load(path):
    def refuse(c):
        raise AssertionError(f"{path}: non-strict JSON constant {c}")
    return json.loads(Path(path).read_text(), parse_constant=refuse)


def cli(*args, env=None, check=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    r = subprocess.run([sys.executable, "-m", "zerotron", *args], cwd=ROOT, env=e, capture_output=True,
                       text=True, timeout=300)
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
    (["--train.grad_clip", "nan"], "train.grad_clip must be a finite number"),
    (["--train.nonfinite", "ignore"], "train.nonfinite must be skip or stop"),
    (["--train.nonfinite_limit", "0"], "train.nonfinite_limit must be >= 1"),
])
def test_nonfinite_config_refused(argv, message, capsys, tmp_path):
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()  # nothing left on disk by a refused run


def test_generate_temperature_nan_refused(capsys):
    code = main(["generate", "--checkpoint", "/no/such", "--prompt", "hi", "--temperature", "nan"])
    err = capsys.readouterr().err
    assert code == 2 and "finite --temperature" in err, err


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


def test_diverging_run_stops_after_limit(tmp_path, data_cache):
    """The issue's reproduction: lr 50 makes the grad norm inf from step 13; three consecutive
    skips stop the run (exit 3, one line naming the step); every checkpoint is finite."""
    run = tmp_path / "div"
    r = cli("train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run), "--train.steps", "24",
            "--train.lr", "50", "--train.warmup_steps", "16", "--checkpoint.every", "2", "--checkpoint.keep", "2",
            "--data.cache_dir", data_cache, "--log.progress", "false", "--log.sample_tokens", "0", check=3)
    lines = [ln for ln in ours(r.stderr) if "non-finite" in ln]
    assert len(lines) == 1 and "consecutive skipped steps" in lines[0], r.stderr
    step = int(lines[0].split("at step ")[1].split()[0])
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == step and recs[-1]["skipped_steps"] >= 3 and "NaN" not in (run / "metrics.jsonl").read_text()
    cks = list_checkpoints(run)
    assert cks and cks[-1][0] <= step and len(cks) == 2
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(cks[-1][1]), str(tmp_path / "last.pt"))
    model = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in model.values() if isinstance(v, torch.Tensor))
