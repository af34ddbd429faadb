"""Run logging: MFU (peak cached per process, re-measured with a warning when MFU > 1), achieved
TFLOP/s, plain progress lines off a terminal, the tqdm bar's validation loss, TensorBoard events
equal to metrics.jsonl, log.tensorboard refusals, log.wandb (refusal; a stub package)."""
import io
import json
import math
import re
import sys
import types

import pytest
import torch

from zerotron import config, config_sections
from zerotron.cli import main
from zerotron.testing_cli import run_cli
from zerotron.train import metrics
from zerotron.train.progress import Progress, format_eta

TINY = "configs/tiny.toml"


def test_peak_cached_per_process_and_refreshed(monkeypatch):
    calls = []

    def fake(device, n=1024, iters=5, dtype=torch.float32, budget_s=0.0):
        calls.append((n, dtype))
        return 1e9 * len(calls)

    monkeypatch.setattr(metrics, "_PEAK_CACHE", {})
    monkeypatch.setattr(metrics, "measure_peak_flops", fake)
    cpu = torch.device("cpu")
    first = metrics.peak_flops(cpu, torch.float32)
    assert first == (1e9, "measured") and [c[0] for c in calls] == [1024]
    assert metrics.peak_flops(cpu, torch.float32) == first and len(calls) == 1  # cached: no new measurement
    assert metrics.peak_flops(cpu, torch.float64)[0] == 2e9 and len(calls) == 2  # another dtype, another key
    assert metrics.peak_flops(cpu, torch.float32, refresh=True)[0] == 3e9 and len(calls) == 3
    assert metrics.peak_flops(cpu, torch.float32)[0] == 3e9 and len(calls) == 3
    calls.extend([None] * 5)  # a refresh that measures less keeps the larger value
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda *a, **k: 1e8)
    assert metrics.peak_flops(cpu, torch.float32, refresh=True)[0] == 3e9


def test_real_peak_measurement_is_stable_enough(monkeypatch, report):
    import time

    monkeypatch.setattr(metrics, "_PEAK_CACHE", {})
    t = time.perf_counter()
    peak, source = metrics.peak_flops(torch.device("cpu"), torch.float32)
    took = time.perf_counter() - t
    assert source == "measured" and 1e8 < peak < 1e14
    report(f"peak FLOP/s measurement: {peak / 1e9:.1f} GFLOP/s fp32 with {torch.get_num_threads()} thread(s) "
           f"in {took:.2f} s")
    assert took < 10


def test_datasheet_peak_for_known_gpus(monkeypatch):
    from zerotron.analysis.hardware import GPUS

    assert metrics.datasheet_peak(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert metrics.datasheet_peak(cuda, torch.bfloat16) == GPUS["h100"]["peak_flops"]
    assert metrics.datasheet_peak(cuda, torch.float32) is None  # fp32 depends on TF32: measured
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Other GPU")
    assert metrics.datasheet_peak(cuda, torch.bfloat16) is None


def test_mfu_above_one_warns_once_and_remeasures(monkeypatch, capsys):
    monkeypatch.setattr(metrics, "peak_flops", lambda device, dtype, refresh=False: (8e9, "measured"))
    f_tok, world = 1e6, 2
    meter = metrics.MFUMeter(f_tok, world, 1e9, torch.device("cpu"), torch.float32)
    ok = meter(1000.0)  # 1000 tok/s * 1e6 / 2 = 5e8 FLOP/s per device: MFU 0.5
    assert ok["mfu"] == pytest.approx(0.5) and ok["tflops_per_device"] == pytest.approx(5e8 / 1e12)
    assert capsys.readouterr().err == ""
    hot = meter(4000.0)  # 2e9 per device vs peak 1e9: MFU 2 -> re-measured peak 8e9 -> 0.25
    err = capsys.readouterr().err
    assert hot["mfu"] == pytest.approx(0.25) and hot["peak_tflops_per_device"] == pytest.approx(8e-3)
    assert len(err.strip().splitlines()) == 1 and "MFU 2.000 > 1" in err and "MFU 0.250" in err
    still = metrics.MFUMeter(f_tok, world, 1e9, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(metrics, "peak_flops", lambda device, dtype, refresh=False: (1e9, "measured"))
    assert still(40000.0)["mfu"] == pytest.approx(20) and "still > 1" in capsys.readouterr().err
    assert still(40000.0)["mfu"] == pytest.approx(20) and capsys.readouterr().err == ""  # warned once


def _rec(step, loss, val=None):
    r = {"step": step, "loss": loss, "tokens_per_s": 1234.5}
    if val is not None:
        r["val_loss"] = val
    return r


def test_progress_plain_lines_off_a_terminal():
    out = io.StringIO()  # isatty() is False, like a log file or CI
    p = Progress(12, 0, every=5, stream=out)
    for s in range(1, 13):
        p.update(_rec(s, 10.0 / s, val={1: 7.5, 6: 3.25}.get(s)))
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(re.match(r"step (\d+)/12 ", ln).group(1)) for ln in lines] == [1, 5, 10, 12]
    assert "loss 10.0000  val 7.5000  tokens/s 1,234  ETA " in lines[0]
    assert "val" not in lines[1] and "loss 2.0000" in lines[1]  # no validation since the last line
    assert "val 3.2500" in lines[2] and "val" not in lines[3]  # the step-6 validation, shown once
    assert all(re.search(r"ETA \d+:\d\d:\d\d$", ln) for ln in lines)
    assert format_eta(3725.4) == "1:02:05"


def test_progress_bar_on_a_terminal_shows_last_val_loss():
    class TTY(io.StringIO):
        def isatty(self):
            return True

    out = TTY()
    p = Progress(5, 0, every=1, stream=out)
    p.update(_rec(1, 4.0, val=4.5))
    p.update(_rec(2, 3.9))
    p.close()
    text = out.getvalue()
    assert "\r" in text and "val=4.500" in text and "loss=3.900" in text and "step 1/5" not in text


def test_tensorboard_refusals(monkeypatch, capsys):
    from zerotron.train import tensorboard as tb

    code = main(["train", "--config", TINY, "--log.tensorboard", "maybe"])
    assert code == 2 and "log.tensorboard must be one of auto, true, false, got 'maybe'" in capsys.readouterr().err
    monkeypatch.setattr(tb, "tensorboard_available", lambda: False)
    code = main(["train", "--config", TINY, "--log.tensorboard", "true"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install tensorboard" in err
    assert tb.tensorboard_enabled("auto") is False and tb.tensorboard_enabled("false") is False


def test_modules_import_without_tensorboard(monkeypatch):
    """No module imports tensorboard at import time (an AST scan), and without the package "auto"
    is off and no writer opens."""
    import ast
    from pathlib import Path

    from zerotron.train import tensorboard as tb

    for path in Path(tb.__file__).parents[1].rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only; lazy imports live in functions
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []  # not .tensorboard
            assert not any("tensorboard" in n for n in names), f"{path}: top-level import of {names}"
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    assert not tb.tensorboard_available() and tb.tensorboard_enabled("auto") is False
    assert tb.open_tensorboard("auto", ".", None, True) is None


def test_train_writes_tensorboard_equal_to_metrics(tmp_path, data_cache):
    """A short tiny run in this process: event file scalars == metrics.jsonl values (float32), mfu
    and tflops_per_device in every row and consistent with tokens/s, the peak measured once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zerotron.train.tensorboard import TAGS

    run = tmp_path / "run"
    assert main(["train", "--config", TINY, "--run-dir", str(run), "--train.steps", "4", "--train.eval_every", "2",
                 "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false",
                 "--data.cache_dir", data_cache, "--log.tensorboard", "true", "--checkpoint.save_final",
                 "false"]) == 0
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    ea = EventAccumulator(str(run))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    for key, tag in TAGS.items():
        want = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        if not want:
            continue
        got = [(e.step, e.value) for e in ea.Scalars(tag)]
        assert got == [(s, float(torch.tensor(v, dtype=torch.float32))) for s, v in want], tag
    assert [e.step for e in ea.Scalars("val/loss")] == [1, 2, 4]
    for op in recs[0]["comm_bytes_by_op"]:
        assert f"comm/{op}" in tags
    assert {"train/loss", "perf/mfu", "perf/tflops_per_device", "memory/model_state_bytes"} <= tags
    cfg = json.loads((run / "config.json").read_text())
    from zerotron.analysis.flops import training_flops_per_token

    assert cfg["log"]["tensorboard"] == "true"
    for r in recs:
        assert 0 < r["mfu"] <= 1
        assert math.isclose(r["mfu"], r["tflops_per_device"] / r["peak_tflops_per_device"], rel_tol=1e-12)
        assert r["tflops_per_device"] > 0
    n_params = recs[0]["model_state_breakdown"]["params_bytes"] // 4  # fp32, one rank holds the whole model
    f_tok = training_flops_per_token(n_params, 4, 64, 64)  # tiny: 4 layers, width 64, sequence 64
    for r in recs:  # world size 1: achieved per device = tokens/s x FLOPs per token
        assert math.isclose(r["tflops_per_device"], r["tokens_per_s"] * f_tok / 1e12, rel_tol=1e-9)
    key = (str(torch.device("cpu")), str(torch.float32), torch.get_num_threads())
    assert key in metrics._PEAK_CACHE


def test_wandb_refusal_is_one_line_exit_2(monkeypatch, capsys):
    """log.wandb = true without the wandb package: one line naming the fix, exit 2, before any
    worker starts; off by default, and on without the package the Trainer path refuses too."""
    from zerotron.train import wandb_log

    assert config_sections.Config().log.wandb is False
    monkeypatch.setattr(wandb_log, "wandb_available", lambda: False)
    for extra in ([], ["--nproc", "2"]):
        code = main(["train", "--config", TINY, "--log.wandb", "true", *extra])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "log.wandb = true needs the wandb package: pip install wandb" in err
    assert wandb_log.open_wandb(False, "p", ".", {}, True) is None
    with pytest.raises(config.ConfigError, match="pip install wandb"):
        wandb_log.open_wandb(True, "p", ".", {}, False)  # every rank refuses alike


def test_wandb_available_matches_the_environment(monkeypatch):
    """Without the package (this venv has no wandb) the check says so without importing; a module
    in sys.modules counts as installed."""
    import importlib.util

    from zerotron.train import wandb_log

    assert wandb_log.wandb_available() is (importlib.util.find_spec("wandb") is not None)
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    assert wandb_log.wandb_available()


def test_no_module_imports_wandb_at_top_level():
    import ast
    from pathlib import Path

    from zerotron.train import wandb_log

    for path in Path(wandb_log.__file__).parents[1].rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            assert not any(n.split(".")[0] == "wandb" for n in names), f"{path}: top-level import of {names}"


def test_wandb_logger_with_a_stub_package(tmp_path, data_cache, monkeypatch):
    """A tiny run with log.wandb = true against a stand-in ``wandb`` module (the real package is not
    installed here): one offline run in <run dir>, the config passed, one log call per step with
    the metrics.jsonl values at the optimizer step, finish() at the end."""
    calls = {"init": [], "log": [], "finish": 0}

    class Run:
        def log(self, row, step):
            calls["log"].append((step, row))

        def finish(self):
            calls["finish"] += 1

    stub = types.ModuleType("wandb")
    stub.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", stub)
    run = tmp_path / "run"
    assert main(["train", "--config", TINY, "--run-dir", str(run), "--train.steps", "3", "--train.eval_every", "2",
                 "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false",
                 "--data.cache_dir", data_cache, "--log.tensorboard", "false", "--checkpoint.save_final", "false",
                 "--log.wandb", "true", "--log.wandb_project", "proj"]) == 0
    (kw,) = calls["init"]
    assert kw["mode"] == "offline" and kw["dir"] == str(run) and kw["project"] == "proj" and kw["name"] == "run"
    assert kw["config"]["log"]["wandb"] is True and kw["config"]["train"]["steps"] == 3
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in calls["log"]] == [r["step"] for r in recs] == [1, 2, 3]
    for (_, row), r in zip(calls["log"], recs):
        assert row["train/loss"] == r["loss"] and row["perf/mfu"] == r["mfu"]
        assert row.get("val/loss") == r.get("val_loss")
        assert {k[5:] for k in row if k.startswith("comm/") and k != "comm/bytes_total"} == set(r["comm_bytes_by_op"])
    assert calls["finish"] == 1


def test_tensorboard_events_survive_a_guard_stop(tmp_path, data_cache):
    """A run stopped by the non-finite guard (exit 3, in its own process) still has every step's
    events on disk: the writer is closed (flushed) on the way out, not only after a full run."""
    import os
    from pathlib import Path

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parent.parent
    run = tmp_path / "run"
    env = {**os.environ, "ZEROTRON_FAULT_NAN_AT_STEPS": "3", "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    r = run_cli(["train", "--config", TINY, "--run-dir", str(run),
                 "--train.steps", "6", "--train.eval_every", "0", "--log.progress", "false",
                 "--log.sample_tokens", "0", "--log.plot", "false", "--data.cache_dir", data_cache,
                 "--log.tensorboard", "true", "--train.nonfinite", "stop", "--checkpoint.save_final", "false"],
                cwd=root, env=env, timeout=120)  # `python -m zerotron train` from the fork server
    assert r.returncode == 3, r.stderr
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    ea = EventAccumulator(str(run))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/lr")] == [r["step"] for r in recs] == [1, 2, 3]
