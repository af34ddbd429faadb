"""Help and version of the CLI: every config field documented in ``train --help`` (from the
dataclasses), every option's default shown, ``bench --help`` works, Ctrl-C of a 2-process run is
one line and exit code 130."""
import dataclasses
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from zerotron import config_sections
from zerotron.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _help(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code or 0
    return code, " ".join(capsys.readouterr().out.split())


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no line wrapping (argparse breaks words at hyphens)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"zerotron {importlib.metadata.version('zerotron')}"
    # anything after it is a usage error, one line, exit 2 (was ignored: the version and exit 0)
    assert main(["--version", "extra"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--version prints the version and takes no arguments" in err, err
    # `zerotron help train`: the train command's own help
    code, out = _help(["help", "train"], capsys)
    assert code == 0 and out.startswith("usage: zerotron train"), out[:200]


def test_train_help_lists_every_config_field(capsys):
    from zerotron.config_doc import attribute_docs

    code, out = _help(["train", "--help"], capsys)
    assert code == 0
    n = 0
    for sec in dataclasses.fields(config_sections.Config):
        cls = type(getattr(config_sections.Config(), sec.name))
        hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
        for f in dataclasses.fields(cls):
            default = str(f.default).lower() if isinstance(f.default, bool) else repr(f.default) \
                if isinstance(f.default, str) else str(f.default)
            entry = f"--{sec.name}.{f.name} {hints[f.name].__name__.upper()} (default: {default})"
            assert entry in out, entry
            assert docs.get(f.name), f"{sec.name}.{f.name} has no attribute docstring in zerotron/config_sections.py"
            assert f"{entry} {docs[f.name]}" in out
            n += 1
    assert n >= 50 and "(undocumented)" not in out
    assert "--log.tensorboard STR (default: 'auto')" in out


def _parsers():
    from zerotron.analysis.dryrun_cli import _parser as dryrun_parser
    from zerotron.analysis.memory_cli import memory_parser
    from zerotron.analysis.plan_cli import _parser as plan_parser
    from zerotron.analysis.schedule_plot import schedule_parser
    from zerotron.bench.comm import _parser as comm_parser
    from zerotron.bench.generate import _parser as bench_generate_parser
    from zerotron.bench.serve import _parser as bench_serve_parser
    from zerotron.bench.train import _parser as bench_train_parser
    from zerotron.bench.validate_plan import _parser as bench_plan_parser
    from zerotron.cli.export import export_parser
    from zerotron.cli.generate import generate_parser
    from zerotron.cli.train import train_parser
    from zerotron.serve import parser as serve_parser

    return {"train": train_parser, "generate": generate_parser, "export": export_parser,
            "memory": memory_parser, "plan": plan_parser, "schedule": schedule_parser, "bench comm": comm_parser,
            "bench train": bench_train_parser, "bench plan": bench_plan_parser, "serve": serve_parser,
            "bench generate": bench_generate_parser, "bench serve": bench_serve_parser, "dryrun": dryrun_parser}


@pytest.mark.parametrize("command", list(_parsers()))
def test_help_shows_every_default(command, capsys):
    import argparse

    parser = _parsers()[command]()
    code, out = _help([*command.split(), "--help"], capsys)
    assert code == 0
    checked = 0
    for a in parser._actions:
        if not a.option_strings or a.default in (None, argparse.SUPPRESS) or isinstance(a.default, bool):
            continue
        assert a.help, f"{command} {a.option_strings[0]} has no help text"
        assert f"(default: {a.default})" in out, (command, a.option_strings, out)
        checked += 1
    assert checked or command in ("export", "dryrun")  # (options without defaults)


def test_bench_help_and_layout_suffixes(capsys):
    code, out = _help(["bench", "--help"], capsys)
    assert code == 0 and "comm" in out and "train" in out and "plan" in out
    code, out = _help(["bench", "train", "--help"], capsys)
    assert code == 0 and "-mbN" in out and "-acselective | -acfull" in out and "(default: dp,dp-torch,single)" in out
    code, out = _help(["generate", "--help"], capsys)
    assert code == 0 and "(default: 100)" in out


def test_ctrl_c_of_two_process_run_is_one_line(tmp_path, data_cache):
    """SIGINT to the launcher's process group (what a terminal's Ctrl-C sends): exit code 130, the
    graceful-stop lines only, no traceback from the launcher or the ranks."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "zerotron", "train", "--config", "configs/tiny.toml", "--nproc", "2",
                          "--run-dir", str(run), "--train.steps", "100000", "--log.progress", "false",
                          "--train.eval_every", "0", "--data.cache_dir", data_cache], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics, t0 = run / "metrics.jsonl", time.time()
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both ranks are training
            assert p.poll() is None and time.time() - t0 < 120, p.communicate()
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # the graceful stop (train.lifecycle): a notice, then the stop line with the resume command,
    # then the launcher's confirmation -- nothing else
    assert lines[0].startswith("zerotron: launching 2 workers") and len(lines) == 4, err
    assert lines[1].startswith("zerotron: SIGINT: finishing the current step"), err
    assert lines[2].startswith("zerotron: stopped by SIGINT at step ") and "--resume" in lines[2], err
    assert lines[3] == "zerotron: interrupted (SIGINT); the 2 workers were stopped"
