#!/usr/bin/env bash
# Reproduce benchmarks/planner_validation.md: calibrate on this machine (bench comm), measure the
# layouts that run here (bench train), then compare the planner's ranking with the measured one.
# Run it on an otherwise idle machine: about 6 minutes on 2 idle CPU cores (the committed run; its
# bench train part alone is 25 layouts x 4 rounds x 7 steps = 3.6 min of measured step time), longer
# on a busy one.
# Results go to a fresh temporary directory (printed at the end); OUT=benchmarks overwrites the
# committed results, OUT=DIR writes to DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
ZT=${ZEROTRON:-.venv/bin/zerotron}
OUT=${OUT:-$(mktemp -d -t planner_validation.XXXXXX)}
mkdir -p "$OUT"
LAYOUTS=dp,dp-torch,single,zero1,zero2,zero3,fsdp2-zero2,fsdp2-zero3,tp,tp-sp,pp-gpipe,pp-1f1b,pp-interleaved
LAYOUTS=$LAYOUTS,dp-mb2,dp-mb4,dp-acselective,dp-acfull,zero3-mb4,tp-mb4,tp-acfull,pp-1f1b-mb4,pp-1f1b-mb2
LAYOUTS=$LAYOUTS,pp-gpipe-mb4,single-mb4,single-acfull
$ZT bench comm --nproc 2 --sizes 4KiB:16MiB --iters 30 --warmup 5 \
    --json "$OUT/comm_cpu.json" --plot "$OUT/comm_cpu.png"
$ZT bench train --nproc 2 --layouts "$LAYOUTS" --rounds 4 --steps 5 --warmup 2 \
    --json "$OUT/planner_layouts_cpu.json" --markdown "$OUT/planner_layouts_cpu.md" --plot "$OUT/planner_layouts_cpu.png"
$ZT bench plan --bench-train "$OUT/planner_layouts_cpu.json" --bench-comm "$OUT/comm_cpu.json" \
    --out "$OUT/planner_validation.md" --json "$OUT/planner_validation.json"
echo "planner validation written to $OUT/planner_validation.md"
