"""Reproduce benchmarks/dryrun_step_time.json: Llama-3-8B on 8 H100 (datasheet, compute_eff 0.5),
dp 8 x ZeRO-3 (native and FSDP2), global batch 16 x 8192 tokens, micro-batch 2 -- torchtitan's
published layout (docs/performance.md, Table 1: 5,762 tokens/s per GPU) -- step time predicted
from the dry run's trace and by the planner's formula.

    python benchmarks/dryrun_step_time.py             # trace the 3 layouts (~2-4 min of CPU each)
    python benchmarks/dryrun_step_time.py --reprice   # re-price the stored traces (after a planner change)

The whole records go to benchmarks/dryrun_step_time_records.json (``--reprice`` reads them: the
trace does not depend on the planner, its pricing and the formula do).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "dryrun_llama3_8b.toml"
BASE = [("parallel.tp", "1"), ("parallel.pp", "1"), ("parallel.zero_stage", "3"), ("train.global_batch", "16"),
        ("train.micro_batch", "2"), ("model.block_size", "8192")]
LAYOUTS = {"fsdp2-full": [("parallel.zero_impl", "fsdp2"), ("train.activation_checkpointing", "full")],
           "zero3-full": [("train.activation_checkpointing", "full")],
           "zero3-none": [("train.activation_checkpointing", "none")]}
WORLD, TOKENS = 8, 16 * 8192


def _cfg(name: str):
    from zerotron.config import load_config

    return load_config(str(CONFIG), BASE + LAYOUTS[name])


def summary(r: dict) -> dict:
    st = r["step_time"]
    return {"step_s_trace": st["trace"]["step_s"], "step_s_formula": st["formula"]["step_s"],
            "tokens_per_s_per_gpu_trace": TOKENS / st["trace"]["step_s"] / WORLD,
            "tokens_per_s_per_gpu_formula": TOKENS / st["formula"]["step_s"] / WORLD,
            "breakdown_s_trace": st["trace"]["breakdown_s"], "breakdown_s_formula": st["formula"]["breakdown_s"],
            "flops_traced": r["flops_traced"], "flops_formula": r["flops_formula"],
            "element_passes": r["counts_traced"]["element_passes"], "peak_bytes_traced": r["peak_bytes_traced"],
            "peak_bytes_estimated": r["peak_bytes_estimated"], "comm_bytes_traced": r["comm_bytes_traced"],
            "comm_bytes_planned": r["comm_bytes_planned"], "wall_s": r["wall_s"]}


def main(argv=None) -> int:
    from zerotron.analysis.dryrun import dry_run, predict_step_time
    from zerotron.analysis.hardware import hardware
    from zerotron.plan import build_plan

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reprice", action="store_true", help="re-price the stored records, trace nothing")
    a = ap.parse_args(argv)
    store = HERE / "dryrun_step_time_records.json"
    raw = json.loads(store.read_text()) if a.reprice else {}
    for name in LAYOUTS:
        cfg = _cfg(name)
        if a.reprice:
            rec = raw[name]
            rec["step_time"] = predict_step_time(cfg, build_plan(cfg, WORLD), [rec], hardware("h100"))
        else:
            raw[name] = dry_run(cfg, WORLD, ranks=[0])[0]
    out = {name: summary(r) for name, r in raw.items()}
    (HERE / "dryrun_step_time.json").write_text(json.dumps(out, indent=1) + "\n")
    store.write_text(json.dumps(raw) + "\n")
    for k, v in out.items():
        print(f"{k}: trace {v['tokens_per_s_per_gpu_trace']:,.0f} tokens/s per GPU, "
              f"formula {v['tokens_per_s_per_gpu_formula']:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
