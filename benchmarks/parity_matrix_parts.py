"""Assemble a full parity-matrix run made in parts into one report.

A long ``make test-matrix`` run is split by ``ZEROTRON_MATRIX_WORLDS`` (and narrowed by
``ZEROTRON_MATRIX_NAMES``); each part appends one JSON record per checked layout to the progress
files ``<out>_<family>.partial.jsonl`` (``tests/test_parity_matrix.py``), but writes the report
only when a run covers every world size. This script reads those progress files and writes
``<out>.json`` and ``<out>.md``: per world size and model family the valid layouts, how many were
checked, the worst relative error of each quantity (bound ``parity.FP64_RTOL``), the seconds
spent, and which valid layouts did not run (by world size; their names in the JSON).

    python benchmarks/parity_matrix_parts.py benchmarks/parity_matrix_cp.json --names cp

Exit code 2 with one line when no progress file exists.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

from zerotron import parity


def _records(out: str, family: str) -> dict:
    # tests/test_parity_matrix.py: family f != gpt2 writes <out>_f.json, its progress <out>_f_f.partial.jsonl
    base = os.path.splitext(out)[0] + ("" if family == "gpt2" else f"_{family}")
    path = f"{base}_{family}.partial.jsonl"
    recs = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    recs[r["name"]] = r
    return recs


def assemble(out: str, names: list[str], worlds: set[int] = frozenset()) -> dict:
    """The report of the progress files of ``out`` over the valid layouts whose name contains one
    of ``names`` (all when empty), of the world sizes ``worlds`` (all when empty: the plan's
    verdict on every layout takes minutes)."""
    chosen = [lay for lay in parity.all_layouts() if (not names or any(n in lay.name for n in names))
              and (not worlds or lay.world in worlds)]
    valid = [lay for lay in chosen if parity.refusal(lay) is None]
    worlds = sorted({lay.world for lay in valid})
    result = {"names": names, "worlds": worlds, "valid": len(valid), "bound": parity.FP64_RTOL, "families": {}}
    for family in parity.MODELS:
        recs = _records(out, family)
        fam = {}
        for w in worlds:
            want = [lay.name for lay in valid if lay.world == w]
            got = [recs[n] for n in want if n in recs]
            witnesses = [r for r in recs.values() if r["world"] == w and r["name"] not in set(want)]
            fam[w] = {"valid": len(want), "checked": len(got),
                      "worst": {k: max((r[k] for r in got + witnesses), default=None) for k in parity.ERRORS},
                      "witnesses_checked": len(witnesses),
                      "seconds": round(sum(r.get("seconds", 0) for r in got + witnesses), 1),
                      "not_run": [n for n in want if n not in recs]}
        result["families"][family] = fam
    return result


def markdown(result: dict) -> str:
    lines = [f"# Parity matrix in parts (layouts named {', '.join(result['names']) or 'any'})", "",
             f"{result['valid']} valid layouts per model family at world sizes {result['worlds']}, each trained in fp64 against one process "
             f"(bound {result['bound']:g}); witnesses: the document-masking, LoRA and offload runs of "
             "those layouts.", "",
             "| family | world | valid | checked | not run | witnesses | worst loss | worst grad norm | "
             "worst val | worst params | worst Adam state | worst full_params | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
    for family, fam in result["families"].items():
        for w, s in sorted(fam.items(), key=lambda kv: int(kv[0])):
            ws = s["worst"]
            lines.append(f"| {family} | {w} | {s['valid']} | {s['checked']} | {len(s['not_run'])} | "
                         f"{s['witnesses_checked']} | " + " | ".join(fmt(ws[k]) for k in
                         ("loss_err", "norm_err", "val_err", "param_err", "optim_err", "full_err"))
                         + f" | {s['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the ZEROTRON_MATRIX_OUT path of the parts (e.g. benchmarks/parity_matrix_cp.json)")
    ap.add_argument("--names", default="", help="comma-separated ZEROTRON_MATRIX_NAMES of the parts")
    ap.add_argument("--worlds", default="", help="comma-separated world sizes to report (default: all)")
    a = ap.parse_args(argv)
    names = [s.strip() for s in a.names.split(",") if s.strip()]
    result = assemble(a.out, names, {int(w) for w in a.worlds.split(",") if w.strip()})
    if not any(s["checked"] or s["witnesses_checked"] for fam in result["families"].values() for s in fam.values()):
        print(f"parity_matrix_parts: no progress file of {a.out} (run tests/test_parity_matrix.py with "
              "ZEROTRON_MATRIX_OUT set first)", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(markdown(result))
    per = defaultdict(int)
    for fam in result["families"].values():
        for w, s in fam.items():
            per[w] += s["checked"]
    print(f"wrote {a.out}: checked per world {dict(per)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
