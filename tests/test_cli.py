"""Bad inputs through the CLI: one clear message each, exit code 2, nothing on disk touched."""
import json
import os

import pytest

from zerotron.cli import main

TINY = "configs/tiny.toml"


def run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


CASES = [
    (["train", "--config", TINY, "--train.stepz", "3"], "unknown config key train.stepz (did you mean 'steps'?)"),
    (["train", "--config", TINY, "--train.steps", "abc"], "train.steps must be int, got 'abc'"),
    (["train", "--config", "nope.toml"], "config file 'nope.toml' not found"),
    (["train", "--config", TINY, "--train.global_batch", "10", "--train.micro_batch", "4"],
     "train.global_batch (10) must be divisible by train.micro_batch * dp"),
    (["train", "--config", TINY, "--model.n_embd", "66"], "model.n_embd (66) must be divisible by model.n_head (4)"),
    (["train", "--config", TINY, "--parallel.dp", "3"], "does not equal the world size 1"),
    (["train", "--config", TINY, "--model.preset", "gpt5"], "model.preset 'gpt5' is unknown"),
    (["train", "--config", TINY, "--data.corpus", "files"], "data.corpus = 'files' needs data.path"),
    (["train", "--config", TINY, "--data.corpus", "files", "--data.path", "/no/such/file.txt"], "/no/such/file.txt"),
    (["train", "--config", TINY, "--train.dtype", "fp8"], "train.dtype must be one of ('fp32', 'bf16'), got 'fp8'"),
    (["train", "--config", TINY, "--train.lr", "-1"], "train.lr must be > 0"),
    (["train", "--config", TINY, "--model.dropout", "1.5"], "model.dropout must be in [0, 1)"),
    (["train", "--config", TINY, "--bogus.key", "1"], "unknown config section 'bogus'"),
    (["train", "--config", TINY, "--train.steps"], "override --train.steps needs a value"),
    (["train", "--config", TINY, "stray"], "unexpected argument 'stray'"),
    (["train", "--config", TINY, "--parallel.dp_impl", "mpi"], "parallel.dp_impl must be one of"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi"], "no checkpoint found at '/no/such/run'"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["bench", "nothing"], "usage: zerotron bench comm|train"),
    (["memory", "--params", "1e6", "--dp", "0"], "dp"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input(argv, message, capsys):
    code, err = run(argv, capsys)
    assert code == 2
    assert message in err, err


def test_bad_toml(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = = 3\n")
    code, err = run(["train", "--config", str(bad)], capsys)
    assert code == 2 and "is not valid TOML" in err
    bad.write_text("[train]\nsteps = 'ten'\n")
    code, err = run(["train", "--config", str(bad)], capsys)
    assert code == 2 and "train.steps must be int, got str 'ten'" in err


def test_existing_run_dir_untouched(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*")}
    code, err = run(["train", "--config", TINY, "--run-dir", str(run_dir)], capsys)
    assert code == 2 and "already holds a run; pass --resume" in err
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*")} == before


def test_resume_without_checkpoint(tmp_path, capsys):
    code, err = run(["train", "--config", TINY, "--run-dir", str(tmp_path / "empty"), "--resume"], capsys)
    assert code == 2 and "--resume: no checkpoint under" in err
    assert not (tmp_path / "empty").exists()


def test_generate_bad_checkpoint_dir(tmp_path, capsys):
    d = tmp_path / "checkpoints" / "step_3"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": 3, "model_config": {"vocab_size": 10}}))
    code, err = run(["generate", "--checkpoint", str(d), "--prompt", "x"], capsys)
    assert code == 2 and "is incomplete (no .metadata" in err


def test_help(capsys):
    assert main(["--help"]) == 0
    assert "commands:" in capsys.readouterr().out
    assert os.path.exists(TINY)
