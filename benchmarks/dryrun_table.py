"""Collect ``zerotron dryrun --json`` files (one per layout) into benchmarks/dryrun_cluster.json and
print the README table (traced vs estimated peak and model states, traced vs planned bytes per
group, wall time and max RSS per layout).

    python benchmarks/dryrun_table.py DIR        # DIR holds NAME.json and time.log from the runs; their
                                                 # ranks' rows are replaced, the other rows kept
    python benchmarks/dryrun_table.py            # re-print from benchmarks/dryrun_cluster.json
    python benchmarks/dryrun_table.py --reestimate   # the same, estimates and planned bytes recomputed (estimator/planner change)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dryrun_cluster.json"
GB = 1e9


def collect(d: Path) -> dict:
    log = (d / "time.log").read_text() if (d / "time.log").exists() else ""
    runs = {}
    for f in sorted(d.glob("*.json")):
        m = re.search(rf"^{re.escape(f.stem)} wall ([\d.]+) s maxrss (\d+) KB", log, re.M)
        slim = []
        for r in json.loads(f.read_text()):
            slim.append({k: r[k] for k in ("rank", "coords", "world", "peak_bytes_traced", "peak_traced", "peak_at",
                                           "peak_bytes_estimated", "estimated", "model_state_bytes", "ratios",
                                           "comm_bytes_traced", "comm_bytes_planned", "oom", "gpu_mem",
                                           "setup_peak_bytes", "layer_counts", "wall_s")}
                         | {k: r[k] for k in ("meta_init", "end_of_step", "construction_bytes") if k in r}
                         | ({"oom_step": r["oom_step"]} if "oom_step" in r else {}))
        # NAME-rR.json: one rank of NAME traced alone (--rank R); its records join NAME's
        run = runs.setdefault(re.sub(r"-r\d+$", "", f.stem), {"records": [], "process_wall_s": None,
                                                               "process_max_rss_bytes": None})
        run["records"] += slim
        if m:
            run["process_wall_s"] = (run["process_wall_s"] or 0) + float(m.group(1))
            run["process_max_rss_bytes"] = max(run["process_max_rss_bytes"] or 0, int(m.group(2)) * 1024)
    return runs


# the layouts of benchmarks/dryrun_acceptance.sh (name -> overrides), to re-run the estimator on
# stored traces: ``python benchmarks/dryrun_table.py --reestimate`` after an estimator change
LAYOUTS = {
    "fsdp2-dp8": "--parallel.tp 1 --parallel.pp 1 --parallel.zero_stage 3 --parallel.zero_impl fsdp2 --train.global_batch 8",
    "zero3-dp8": "--parallel.tp 1 --parallel.pp 1 --parallel.zero_stage 3 --train.global_batch 8",
    "tp8": "--parallel.tp 8 --parallel.pp 1 --parallel.zero_stage 0 --train.global_batch 1",
    "zero1-pp4-dp16": "--parallel.tp 1 --parallel.pp 4 --parallel.zero_stage 1 --train.global_batch 128",
    "zero1-tp8-pp4-dp32": "--parallel.tp 8 --parallel.pp 4 --parallel.zero_stage 1 --train.global_batch 256",
}


def reestimate(runs: dict) -> None:
    """Recompute each record's estimate (``analysis.dryrun.estimate``), peak ratio and planned bytes
    per group (``analysis.dryrun.planned_comm`` with the record's layer split) in place."""
    from zerotron.analysis.dryrun import _ratio, estimate, planned_comm
    from zerotron.config import load_config, parse_overrides
    from zerotron.plan import build_plan

    root = Path(__file__).resolve().parents[1]
    for name, run in runs.items():
        lay = max((k for k in LAYOUTS if f"-{k}-" in name), key=len, default=None)
        if lay is None:
            continue
        model, rec = name.split(f"-{lay}-")
        args = [*LAYOUTS[lay].split(), "--model.preset", model, "--train.activation_checkpointing", rec]
        cfg = load_config(str(root / "configs" / "dryrun_llama3_8b.toml"), parse_overrides(args))
        for r in run["records"]:
            est = estimate(cfg, build_plan(cfg, r["world"]), r["coords"]["pp"], r["layer_counts"],
                           r["coords"].get("tp", 0))
            r["estimated"], r["peak_bytes_estimated"] = est, est["total"]
            r["ratios"]["peak"] = r["peak_bytes_traced"] / est["total"]
            planned = planned_comm(cfg, build_plan(cfg, r["world"]), r["coords"]["pp"], r["layer_counts"])
            r["comm_bytes_planned"] = planned
            r["ratios"]["comm"] = {g: _ratio(r["comm_bytes_traced"].get(g, 0), b) for g, b in planned.items()}


def table(runs: dict) -> str:
    head = ("| layout | world | rank (pp) | peak traced GB | estimated GB | ratio | states ratio | "
            "dp / tp / pp bytes traced : planned | construction GB | OOM at 80 GB | s per rank | RSS GiB |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, run in runs.items():
        for r in run["records"]:
            comm = []
            for g in ("dp", "tp", "pp"):
                p = r["comm_bytes_planned"].get(g)
                if p:
                    comm.append(f"{g} {r['comm_bytes_traced'].get(g, 0) / p:.2f}")
            step = r.get("oom_step", r["oom"])
            step = None if step and step["phase"] == "setup" else step
            oom = [f"setup ({r['setup_peak_bytes'] / GB:.3g} GB)"] if r["setup_peak_bytes"] > r["gpu_mem"] else []
            oom += [f"{step['phase']}: {step['category']}"] if step else []
            rss = run["process_max_rss_bytes"]
            rows.append(f"| {name} | {r['world']} | {r['rank']} ({r['coords']['pp']}) | "
                        f"{r['peak_bytes_traced'] / GB:.3g} | {r['peak_bytes_estimated'] / GB:.3g} | "
                        f"{r['ratios']['peak']:.3f} | {r['ratios']['model_states']:.3f} | {', '.join(comm) or '-'} | "
                        + (f"{r['construction_bytes'] / GB:.3g} ({r['setup_peak_bytes'] / GB:.3g} dense) | "
                           if r.get("construction_bytes") else f"{r['setup_peak_bytes'] / GB:.3g} (dense) | ")
                        + ("; ".join(oom) or "no")
                        + f" | {r['wall_s']:.0f} | " + (f"{rss / 2**30:.2f}" if rss else "-") + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv and argv[0] != "--reestimate":
        new = collect(Path(argv[0]))
        reestimate(new)
        runs = json.loads(OUT.read_text()) if OUT.exists() else {}
        for name, run in new.items():  # a re-run of some ranks (--rank) keeps the layout's other records
            kept = [r for r in runs.get(name, {}).get("records", []) if r["rank"] not in {x["rank"] for x in run["records"]}]
            run["records"] = sorted(kept + run["records"], key=lambda r: r["rank"])
        runs = dict(sorted({**runs, **new}.items()))
        OUT.write_text(json.dumps(runs, indent=1) + "\n")
    else:
        runs = json.loads(OUT.read_text())
        if argv:
            reestimate(runs)
            OUT.write_text(json.dumps(runs, indent=1) + "\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
