"""End to end through the CLI on the real corpus with 2 processes: training, metrics, kill -9 +
resume equals an uninterrupted run (bitwise), LR schedule, generation (single and data-parallel).
The uninterrupted reference runs ``zerotron train`` as each of its two workers runs it, on the pooled
ranks; the killed run and its resume go through the ``--nproc 2`` launcher."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from zerotron.cli.main import main
from zerotron.config import load_config
from zerotron.testing import checkpoint_flat, run_ranks_captured
from zerotron.testing_cli import run_cli
from zerotron.train.checkpoint import list_checkpoints
from zerotron.train.optim import lr_at

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


def zerotron(*args, env=None, check=True):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    r = run_cli(list(args), cwd=ROOT, env=e, timeout=300)  # `python -m zerotron ...`, imports preloaded
    if check and r.returncode != 0:
        raise AssertionError(f"zerotron {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def train_args(run_dir, cache):
    return ["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run_dir),
            "--train.steps", str(STEPS), "--model.dropout", "0.1", "--train.micro_batch", "2",
            "--checkpoint.every", "3", "--checkpoint.keep", "0", "--train.eval_every", "3",
            "--data.cache_dir", cache, "--log.progress", "false"]


def load_flat(ckpt_dir, tmp):
    return checkpoint_flat(ckpt_dir, tmp / (ckpt_dir.parent.parent.name + ckpt_dir.name + ".pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("e2e")
    # the reference as the launch's two workers run it (2 fresh interpreters fewer); rank 0's output
    argv = train_args(tmp / "full", data_cache)
    i = argv.index("--nproc")
    ranks = run_ranks_captured(main, 2, argv[:i] + argv[i + 2:], env={"OMP_NUM_THREADS": "1"}, join_timeout_s=300)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    full = {"stdout": ranks[0][1]}
    killed = zerotron(*train_args(tmp / "killed", data_cache), env={"ZEROTRON_FAULT_KILL_AT_STEP": "4"}, check=False)
    resumed = zerotron(*train_args(tmp / "killed", data_cache), "--resume")
    return {"tmp": tmp, "full": full, "killed": killed, "resumed": resumed}


def test_training_outputs(runs):
    run = runs["tmp"] / "full"
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "comm_bytes"):
        assert all(key in r for r in recs), key
    assert all(r["comm_bytes"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in recs)
    assert "val_loss" in recs[2] and "val_loss" in recs[5]
    assert recs[-1]["loss"] < recs[0]["loss"]            # it learns
    assert (run / "loss.png").stat().st_size > 1000
    assert "sample:" in runs["full"]["stdout"]
    cfg = load_config(ROOT / "configs" / "tiny.toml", [("train.steps", str(STEPS))])
    for r in recs:  # LR after k optimizer steps equals the formula (accumulation 2 here)
        assert math.isclose(r["lr"], lr_at(r["step"] - 1, cfg.train), rel_tol=1e-12)
    assert [s for s, _ in list_checkpoints(run)] == [3, 6]


def test_kill_and_resume_equals_uninterrupted(runs):
    assert runs["killed"].returncode != 0
    assert "failed" in runs["killed"].stderr
    killed = runs["tmp"] / "killed"
    recs = [json.loads(ln) for ln in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))   # no duplicated step lines
    a = load_flat(runs["tmp"] / "full" / "checkpoints" / f"step_{STEPS}", runs["tmp"])
    b = load_flat(killed / "checkpoints" / f"step_{STEPS}", runs["tmp"])
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k                           # bitwise
        else:
            assert a[k] == b[k], k
    full = [json.loads(ln) for ln in (runs["tmp"] / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in full] == [r["loss"] for r in recs]


def test_generate(runs):
    run = runs["tmp"] / "full"
    one = zerotron("generate", "--checkpoint", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "12").stdout
    two = zerotron("generate", "--checkpoint", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "12").stdout
    assert one == two and one.startswith("ROMEO:")
    prompts = runs["tmp"] / "prompts.txt"
    prompts.write_text("ROMEO:\nJULIET:\nKING HENRY:\n")
    dp = zerotron("generate", "--checkpoint", str(run), "--prompts-file", str(prompts), "--max-new-tokens", "12",
                  "--nproc", "2").stdout
    single = zerotron("generate", "--checkpoint", str(run), "--prompts-file", str(prompts),
                      "--max-new-tokens", "12").stdout
    assert dp == single and dp.index("[0]") < dp.index("[1]") < dp.index("[2]")
    assert one.strip() in dp


def test_incomplete_checkpoint_ignored(tmp_path):
    (tmp_path / "checkpoints" / ".tmp_step_9").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_4").mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4]
