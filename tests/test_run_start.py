"""One place builds the plan and checks a resume: ``zerotron train`` decides both once per process
(before anything is written) and the Trainer takes its verdict instead of deciding again."""
from __future__ import annotations

import pytest

import zerotron.plan as plan_mod
import zerotron.train.setup as setup_mod
import zerotron.train.trainer as trainer_mod
from zerotron.cli.train import cmd_train
from zerotron.plan import build_plan
from zerotron.testing import tiny_config


def _counting(monkeypatch):
    calls = {"plan": 0, "resume": 0}
    real_plan, real_resume = plan_mod.build_plan, setup_mod.check_resume

    def plan(*a, **k):
        calls["plan"] += 1
        return real_plan(*a, **k)

    def resume(*a, **k):
        calls["resume"] += 1
        return real_resume(*a, **k)

    monkeypatch.setattr(plan_mod, "build_plan", plan)
    monkeypatch.setattr(trainer_mod, "build_plan", plan)
    monkeypatch.setattr(setup_mod, "check_resume", resume)
    monkeypatch.setattr(trainer_mod, "check_resume", resume)
    return calls


def test_train_builds_plan_and_checks_resume_once(tmp_path, data_cache, monkeypatch, single_process):
    args = ["--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "run"), "--data.cache_dir", data_cache,
            "--train.steps", "1", "--checkpoint.every", "1", "--log.progress", "false", "--log.plot", "false",
            "--log.sample_tokens", "0", "--train.eval_every", "0", "--train.eval_batches", "1"]
    calls = _counting(monkeypatch)
    assert cmd_train(args) == 0
    assert calls == {"plan": 1, "resume": 0}
    calls = _counting(monkeypatch)
    assert cmd_train([*args, "--train.steps", "2", "--resume"]) == 0
    assert calls == {"plan": 1, "resume": 1}, "the plan and the resume check are decided once, by zerotron train"


def test_trainer_refuses_a_plan_of_another_world(tmp_path, data_cache, single_process):
    cfg = tiny_config({"data.cache_dir": data_cache})
    with pytest.raises(ValueError, match="world size 2"):
        trainer_mod.Trainer(cfg, tmp_path / "run", plan=build_plan(cfg, 2))
    assert not (tmp_path / "run").exists(), "refused before anything is written"
