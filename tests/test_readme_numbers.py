"""README.md's measured figures equal what ``benchmarks/readme_numbers.py`` computes from the
files under benchmarks/ (fast: JSON only, no torch, no processes)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "readme_numbers.py"


def _module():
    spec = importlib.util.spec_from_file_location("readme_numbers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_figures_are_current():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, ("stale README figures; run `python benchmarks/readme_numbers.py`:\n"
                               + r.stdout + r.stderr)
    assert len(_module().SPAN.findall((ROOT / "README.md").read_text())) >= 10


def test_changed_json_value_is_detected(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    for f in (ROOT / "benchmarks").glob("*.json"):
        shutil.copy(f, bench / f.name)
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    pm = json.loads((bench / "parity_matrix.json").read_text())
    pm["valid"] += 1
    (bench / "parity_matrix.json").write_text(json.dumps(pm))
    args = [sys.executable, str(SCRIPT), "--readme", str(readme), "--bench-dir", str(bench)]
    r = subprocess.run([*args, "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    want = f"parity.valid: README has '{pm['valid'] - 1:,}', benchmarks give '{pm['valid']:,}'"
    assert want in r.stdout
    assert "parity.layouts" in r.stdout  # valid + refused changed too
    assert readme.read_text() == (ROOT / "README.md").read_text()  # --check writes nothing
    assert subprocess.run(args, capture_output=True, timeout=60).returncode == 0  # regenerate
    assert f"<!-- n:parity.valid -->{pm['valid']:,}<!-- /n -->" in readme.read_text()
    assert subprocess.run([*args, "--check"], capture_output=True, timeout=60).returncode == 0


def test_render_unit():
    m = _module()
    text = "a <!-- n:x -->1<!-- /n --> b <!-- n:y -->2<!-- /n --> <!-- n:z -->3<!-- /n -->"
    new, stale, unknown = m.render(text, {"x": "1", "y": "5"})
    assert new == "a <!-- n:x -->1<!-- /n --> b <!-- n:y -->5<!-- /n --> <!-- n:z -->3<!-- /n -->"
    assert stale == [("y", "2", "5")] and unknown == ["z"]
    assert m._span(1.28, 2.03) == "1.3–2.0" and m._span(0.28, 0.31) == "0.3"
