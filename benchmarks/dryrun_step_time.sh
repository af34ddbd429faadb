#!/usr/bin/env bash
# Reproduce benchmarks/dryrun_step_time.json: Llama-3-8B on 8 H100 (datasheet, compute_eff 0.5),
# dp 8 x ZeRO-3 (native and FSDP2), global batch 16 x 8192 tokens, micro-batch 2 -- torchtitan's
# published layout (docs/performance.md, Table 1: 5,762 tokens/s per GPU) -- step time predicted
# from the dry run's trace and by the planner's formula. ~2-4 min of CPU per layout.
set -euo pipefail
cd "$(dirname "$0")/.."
ZT=${ZEROTRON:-.venv/bin/zerotron}
TMP=$(mktemp -d -t dryrun_step_time.XXXXXX)
for lay in "fsdp2-full:--parallel.zero_impl fsdp2 --train.activation_checkpointing full" \
           "zero3-full:--train.activation_checkpointing full" "zero3-none:--train.activation_checkpointing none"; do
    name=${lay%%:*}
    # shellcheck disable=SC2086
    $ZT dryrun --config configs/dryrun_llama3_8b.toml --world 8 --parallel.tp 1 --parallel.pp 1 \
        --parallel.zero_stage 3 --train.global_batch 16 --train.micro_batch 2 --model.block_size 8192 \
        ${lay#*:} --json "$TMP/$name.json" > "$TMP/$name.log"
done
.venv/bin/python - "$TMP" <<'PY'
import json, sys
from pathlib import Path
out = {}
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())[0]
    st = r["step_time"]
    tokens = 16 * 8192
    out[f.stem] = {"step_s_trace": st["trace"]["step_s"], "step_s_formula": st["formula"]["step_s"],
                   "tokens_per_s_per_gpu_trace": tokens / st["trace"]["step_s"] / 8,
                   "tokens_per_s_per_gpu_formula": tokens / st["formula"]["step_s"] / 8,
                   "breakdown_s_trace": st["trace"]["breakdown_s"], "breakdown_s_formula": st["formula"]["breakdown_s"],
                   "flops_traced": r["flops_traced"], "flops_formula": r["flops_formula"],
                   "element_passes": r["counts_traced"]["element_passes"], "peak_bytes_traced": r["peak_bytes_traced"],
                   "peak_bytes_estimated": r["peak_bytes_estimated"], "comm_bytes_traced": r["comm_bytes_traced"],
                   "comm_bytes_planned": r["comm_bytes_planned"], "wall_s": r["wall_s"]}
Path("benchmarks/dryrun_step_time.json").write_text(json.dumps(out, indent=1) + "\n")
for k, v in out.items():
    print(f"{k}: trace {v['tokens_per_s_per_gpu_trace']:,.0f} tokens/s per GPU, formula {v['tokens_per_s_per_gpu_formula']:,.0f}")
PY
