"""README.md's examples run: every ``bash``/``python`` block carries a ``readme-test`` marker, and the
blocks marked ``run`` are executed in README order in one temporary directory (the shrink rule and
marker convention are stated in README next to the quick start)."""
from __future__ import annotations

import os
import re
import shlex
import time
from pathlib import Path

from zerotron.testing_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = re.compile(r"^<!--\s*readme-test:\s*(run|skip\s*\((?P<reason>[^)]+)\))\s*-->$")
# Appended to every `zerotron train` command (later flags win); the same list is quoted in README.
TRAIN_SHRINK = ["--config", "configs/tiny.toml", "--train.steps", "4", "--train.eval_every", "2",
                "--log.sample_tokens", "0", "--log.plot", "false", "--log.progress", "false"]


SMALL_CONFIGS = ("configs/tiny.toml", "configs/llama_tiny.toml")  # kept when a command names one


def shrink(argv: list[str]) -> list[str]:
    """TRAIN_SHRINK for one ``zerotron train`` command, without its ``--config`` when the command
    already names one of SMALL_CONFIGS."""
    own = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    return TRAIN_SHRINK[2:] if own in SMALL_CONFIGS else TRAIN_SHRINK


def readme_blocks(text: str) -> list[dict]:
    """``[{"lang", "mode" ("run" | "skip" | None), "reason", "lines", "line_no"}]`` for every fenced
    block; ``mode`` comes from a marker on the line just before the fence."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        prev = lines[i - 1].strip() if i else ""
        mk = MARKER.match(prev)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        blocks.append({"lang": m.group(1), "mode": (mk.group(1)[:4].rstrip() if mk else None),
                       "reason": mk.group("reason") if mk else None, "lines": lines[i + 1:j], "line_no": i + 1})
        i = j + 1
    return blocks


def shell_commands(lines: list[str]) -> list[list[str]]:
    """Command lines of a bash block: ``\\`` continuations joined, ``# comments`` dropped."""
    cmds, cur = [], ""
    for line in lines:
        cur += line
        if cur.rstrip().endswith("\\"):
            cur = cur.rstrip()[:-1] + " "
            continue
        argv = shlex.split(cur, comments=True)
        if argv:
            cmds.append(argv)
        cur = ""
    assert not cur.strip(), f"dangling continuation: {cur!r}"
    return cmds


def test_shrink_keeps_small_configs():
    assert shrink(["zerotron", "train", "--config", "configs/llama_tiny.toml"])[:2] == ["--train.steps", "4"]
    assert shrink(["zerotron", "train", "--config", "configs/default.toml"])[:2] == ["--config", "configs/tiny.toml"]
    assert shrink(["zerotron", "train"]) == TRAIN_SHRINK


def test_parser():
    assert shell_commands(['zerotron train --a 1 \\', '    --b "x y"   # note', "# only a comment", ""]) == [
        ["zerotron", "train", "--a", "1", "--b", "x y"]]
    b = readme_blocks("<!-- readme-test: skip (two nodes) -->\n```bash\nls\n```\n```\nout\n```\n")
    assert [(x["lang"], x["mode"], x["reason"]) for x in b] == [("bash", "skip", "two nodes"), ("", None, None)]


def test_readme_blocks_run(tmp_path, data_cache, report):
    blocks = [b for b in readme_blocks(README.read_text()) if b["lang"] in ("bash", "sh", "python")]
    unmarked = [b["line_no"] for b in blocks if b["mode"] is None]
    assert not unmarked, f"README.md code blocks without a readme-test marker at lines {unmarked}"
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "zerotron").symlink_to(data_cache)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           # as a user runs them: --nproc workers are fresh interpreters (the path that every other test's
           # launches skip, see conftest.py), kept tested here
           "ZEROTRON_FORK_WORKERS": "0"}
    ran, skipped_cmds, skipped_blocks, t0 = 0, 0, 0, time.perf_counter()
    for b in blocks:
        if b["mode"] == "skip":
            skipped_blocks += 1
            skipped_cmds += len(shell_commands(b["lines"])) if b["lang"] != "python" else 1
            continue
        if b["lang"] == "python":
            script = tmp_path / f"readme_block_{b['line_no']}.py"
            script.write_text("\n".join(b["lines"]) + "\n")
            runs = [(dict(argv=[], script=script), f"python block at README line {b['line_no']}")]
        else:
            runs = []
            for argv in shell_commands(b["lines"]):
                assert argv[0] == "zerotron", f"README line {b['line_no']}: runnable blocks hold zerotron commands, got {argv}"
                full = argv[1:] + (shrink(argv) if argv[1:2] == ["train"] else [])
                runs.append((dict(argv=full), shlex.join(argv)))
        for cmd, what in runs:
            # a child of the fork server: `python -m zerotron ...` / `python block.py` without the
            # 2-3 s of imports each (--nproc workers are started fresh by torch elastic: env above)
            r = run_cli(**cmd, cwd=tmp_path, env=env, timeout=300)
            assert r.returncode == 0, (f"README command failed (exit {r.returncode}): {what}\n"
                                       f"--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-3000:]}")
            ran += 1
    assert ran, "no README block is marked runnable"
    report(f"README: ran {ran} commands/blocks, skipped {skipped_cmds} commands in {skipped_blocks} blocks "
           f"({time.perf_counter() - t0:.0f} s)")


def config_table(text: str) -> list[tuple[str, list[str], list[str]]]:
    """``[(section, fields, defaults)]`` of the README "Configuration" table (comma lists split)."""
    part = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isidentifier() and cells[0] != "section":
            rows.append((cells[0], [f.strip() for f in cells[1].split(",")], [d.strip() for d in cells[2].split(", ")]))
    return rows


def _readme_default(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return '""' if v == "" else str(v)


def test_config_table_names_every_field_once_with_its_default():
    """Every field of the config dataclasses is in README's table exactly once (no duplicate, none
    missing, no stale name); where a row gives one default per field, each equals the code's."""
    from collections import Counter

    from zerotron.config_doc import config_fields

    fields = {r["key"]: r["default"] for r in config_fields()}
    rows = config_table(README.read_text())
    named = Counter(f"{sec}.{f}" for sec, fs, _ in rows for f in fs)
    assert not [k for k, n in named.items() if n > 1], "listed twice in README's config table"
    assert not [k for k in fields if k not in named], "config fields missing from README's config table"
    assert not [k for k in named if k not in fields], "README's config table names fields the code lacks"
    checked = 0
    for sec, fs, ds in rows:
        if len(fs) != len(ds):  # a prose default ("0 (= preset or ...)")
            continue
        for f, d in zip(fs, ds):
            want = fields[f"{sec}.{f}"]
            ok = float(d) == float(want) if isinstance(want, (int, float)) and not isinstance(want, bool) \
                else d.strip('"') == _readme_default(want).strip('"')
            assert ok, f"README's config table: {sec}.{f} default {d}, the code has {want!r}"
            checked += 1
    assert checked >= 50


def test_config_table_parser_catches_a_duplicate():
    text = "x\n## Configuration\n| section | field | default | meaning |\n|---|---|---|---|\n" \
           "| parallel | tp, pp | 1, 1 | |\n| parallel | tp | 1 | |\n## Features\n"
    assert config_table(text) == [("parallel", ["tp", "pp"], ["1", "1"]), ("parallel", ["tp"], ["1"])]
