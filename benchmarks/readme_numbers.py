"""Regenerate the measured figures in README.md from the files under benchmarks/.

Usage: ``python benchmarks/readme_numbers.py [--check] [--readme README.md] [--bench-dir benchmarks]``.

Every generated figure in README.md sits in a span ``<!-- n:NAME -->VALUE<!-- /n -->`` (HTML
comments: invisible when the Markdown is rendered). :func:`compute_figures` derives each NAME's
text from the JSON files here (no torch import, runs in well under a second); without ``--check``
the spans' values are rewritten in place, with ``--check`` nothing is written and the script exits 1
after one line per stale figure (``NAME: README has X, benchmarks give Y``). A span naming a figure
this script does not know is an error in both modes (exit 2). Figures that no file under
benchmarks/ contains are left as plain text.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPAN = re.compile(r"<!-- n:(?P<name>[A-Za-z0-9_.\-]+) -->(?P<value>.*?)<!-- /n -->", re.S)

# README figure name -> layout in planner_layouts_cpu.json ("all layouts in one run").
LAYOUTS = ("dp", "dp-torch", "zero1", "zero2", "zero3", "fsdp2-zero2", "fsdp2-zero3", "tp", "tp-sp",
           "pp-gpipe", "pp-1f1b", "pp-interleaved", "single")


def _load(bench: Path, name: str):
    return json.loads((bench / name).read_text())


def _by_layout(rows: list[dict]) -> dict[str, dict]:
    return {r["layout"]: r for r in rows if not r.get("skipped")}


def _int(x: float) -> str:
    return f"{round(x):,}"


def _span(lo: float, hi: float, fmt: str = ".1f") -> str:
    """``"a–b"`` of the rounded bounds, or one value when they round equal."""
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}–{b}"


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of the per-round ratio a/b (the bench's ``vs X`` convention)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def compute_figures(bench: Path = HERE) -> dict[str, str]:
    """``{name: text}`` of every README figure, computed from the files in ``bench``."""
    bench = Path(bench)
    f: dict[str, str] = {}

    pm = _load(bench, "parity_matrix.json")
    w = pm["worst"]
    f["parity.layouts"] = _int(pm["valid"] + pm["refused"])
    f["parity.valid"] = _int(pm["valid"])
    f["parity.refused"] = _int(pm["refused"])
    f["parity.checked"] = _int(pm["checked"])
    f["parity.worst_param"] = f"{max(w['param_err'], w['optim_err'], w['full_err']):.1e}"
    f["parity.worst_loss"] = f"{max(w['loss_err'], w['val_err']):.1e}"
    f["parity.seconds"] = _int(pm["seconds"])

    # make test-matrix-cp: every valid context-parallel layout of both families (written when complete)
    cps = [_load(bench, n) for n in ("parity_matrix_cp_full.json", "parity_matrix_cp_full_llama.json")
           if (bench / n).is_file()]
    if len(cps) == 2:
        f["cpfull.checked"] = _int(sum(d["checked"] for d in cps))
        for d in cps:
            f[f"cpfull.{d['model']}"] = _int(d["checked"])
            f[f"cpfull.{d['model']}.worst"] = f"{max(d['worst'].values()):.1e}"

    cm = _load(bench, "comm_cpu.json")
    ar16 = [r for r in cm["results"] if r["op"] == "all_reduce" and r["mode"] == "blocking"
            and r["requested_bytes"] == 16 << 20]
    f["comm.all_reduce_busbw_16MiB"] = f"{ar16[0]['busbw_GBps']:.1f}"

    pv = _load(bench, "planner_validation.json")
    lat = pv["hardware"]["latency_us"]
    low = [lat["all_gather"] / 1e3, lat["p2p"] / 1e3]
    high = [lat["all_reduce"] / 1e3, lat["reduce_scatter"] / 1e3]
    f["comm.latency_ag_p2p_ms"] = _span(min(low), max(low))
    f["comm.latency_ar_rs_ms"] = _span(min(high), max(high))

    pl = _by_layout(_load(bench, "planner_layouts_cpu.json"))
    for name in LAYOUTS:
        f[f"train.{name}"] = _int(pl[name]["tokens_per_s"])
    f["train.best"] = _int(max(r["tokens_per_s"] for r in pl.values()))
    f["train.zero3_vs_fsdp2"] = f"{_paired(pl['zero3']['tokens_per_s_rounds'], pl['fsdp2-zero3']['tokens_per_s_rounds']):.2f}"
    f["train.dp_vs_torch"] = f"{pl['dp']['ratio_vs_dp-torch']:.2f}"

    st = _by_layout(_load(bench, "strategies_cpu.json"))  # older run: ratio of the median tokens/s
    f["strategies.zero3_vs_fsdp2"] = f"{st['zero3']['tokens_per_s'] / st['fsdp2-zero3']['tokens_per_s']:.2f}"
    f["strategies.dp_vs_torch"] = f"{st['dp']['ratio_vs_dp-torch']:.2f}"
    f["train_cpu.dp_vs_torch"] = f"{_by_layout(_load(bench, 'train_cpu.json'))['dp']['ratio_vs_dp-torch']:.2f}"

    ep = _by_layout(_load(bench, "epoch_1_vs_2.json"))
    f["epoch.single_tps"] = _int(ep["single"]["tokens_per_s"])
    f["epoch.dp_tps"] = _int(ep["dp"]["tokens_per_s"])
    f["epoch.single_s"] = _int(ep["single"]["epoch_time_s"])
    f["epoch.dp_s"] = _int(ep["dp"]["epoch_time_s"])

    sv = pv["spearman_variants"]
    f["planner.layouts"] = _int(len(pv["layouts"]))
    f["planner.spearman"] = f"{pv['spearman']:.3f}"
    f["planner.spearman_same_world"] = f"{sv['same_world']:.3f}"
    f["planner.spearman_base"] = f"{sv['base_layouts']:.3f}"
    f["planner.base_n"] = _int(sv["base_layouts_n"])
    opt = [r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] for r in pv["layouts"]]
    f["planner.optimism"] = _span(min(opt), max(opt))

    sc = {r["mode"]: r for r in _load(bench, "serve_continuous_cpu.json")}  # bench serve, paired rounds
    c, w = sc["continuous"], sc["window"]
    f["serve.offered_tps"] = _int(c["offered_tokens_per_s"])
    for mode, r in (("cont", c), ("win", w)):
        f[f"serve.{mode}_tps"] = _int(r["output_tokens_per_s"])
        for k in ("latency_mean_s", "latency_p95_s", "ttft_mean_s"):
            f[f"serve.{mode}_{k[:-2]}_ms"] = _int(r[k] * 1e3)
    for k in ("output_tokens_per_s", "latency_mean_s", "latency_p95_s", "ttft_mean_s"):
        f[f"serve.ratio_{k}"] = f"{c['ratio_' + k]:.2f}"
    c2 = {r["mode"]: r for r in _load(bench, "serve_continuous_cpu_pp2.json")}["continuous"]  # 2-stage pipeline
    for k in ("output_tokens_per_s", "latency_mean_s", "latency_p95_s"):
        f[f"serve_pp2.ratio_{k}"] = f"{c2['ratio_' + k]:.2f}"
    dl = {r["dropout"]: r for r in _load(bench, "dropout_layout_cpu.json")}  # dp 2 -> one process at step 4
    f["dropout.layout_move"] = f"{dl[0.1]['max_rel_loss_diff_steps_5_8']:.1e}"
    f["dropout.layout_move_off"] = f"{dl[0.0]['max_rel_loss_diff_steps_5_8']:.2g}"
    return f


def render(text: str, figures: dict[str, str]) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """``(new_text, stale, unknown)``: ``text`` with every span's value set from ``figures``;
    ``stale`` lists ``(name, old, new)`` per span whose value changed, ``unknown`` the span names
    ``figures`` lacks (left unchanged)."""
    stale, unknown = [], []

    def sub(m: re.Match) -> str:
        name, old = m.group("name"), m.group("value")
        if name not in figures:
            unknown.append(name)
            return m.group(0)
        if old != figures[name]:
            stale.append((name, old, figures[name]))
        return f"<!-- n:{name} -->{figures[name]}<!-- /n -->"
    return SPAN.sub(sub, text), stale, unknown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report stale figures (exit 1 if any)")
    p.add_argument("--readme", type=Path, default=HERE.parent / "README.md")
    p.add_argument("--bench-dir", type=Path, default=HERE)
    args = p.parse_args(argv)
    text = args.readme.read_text()
    new, stale, unknown = render(text, compute_figures(args.bench_dir))
    for name in unknown:
        print(f"{args.readme}: unknown figure {name!r} (not computed by {Path(__file__).name})", file=sys.stderr)
    if unknown:
        return 2
    for name, old, want in stale:
        print(f"{args.readme}: {name}: README has {old!r}, benchmarks give {want!r}")
    if args.check:
        return 1 if stale else 0
    if new != text:
        args.readme.write_text(new)
    print(f"{args.readme}: {len(SPAN.findall(new))} figures, {len(stale)} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
