#!/usr/bin/env bash
# Reproduce benchmarks/dryrun_cluster.json (issue 33's acceptance rows): per model preset and layout,
# with and without full recomputation, `zerotron dryrun --gpu-mem 80GB --json` (bf16, micro-batch 1,
# sequence = the preset's block size), wall time and max RSS of each process in time.log, then
# benchmarks/dryrun_table.py collects them and prints the README table.
#   benchmarks/dryrun_acceptance.sh [MODELS] [RECOMPUTE]    e.g. "llama3-8b gpt2-medium" "none full"
# Minutes of CPU per traced rank at full size (1,024-rank layouts: two ranks each).
set -euo pipefail
cd "$(dirname "$0")/.."
ZT=${ZEROTRON:-.venv/bin/zerotron}
OUT=${OUT:-$(mktemp -d -t dryrun_acceptance.XXXXXX)}
MODELS=${1:-"gpt2-medium llama3-8b llama3-70b"}
RECOMPUTE=${2:-"none full"}
LAYOUTS=(
  "fsdp2-dp8:8:--parallel.tp 1 --parallel.pp 1 --parallel.zero_stage 3 --parallel.zero_impl fsdp2 --train.global_batch 8"
  "zero3-dp8:8:--parallel.tp 1 --parallel.pp 1 --parallel.zero_stage 3 --train.global_batch 8"
  "tp8:8:--parallel.tp 8 --parallel.pp 1 --parallel.zero_stage 0 --train.global_batch 1"
  "zero1-pp4-dp16:64:--parallel.tp 1 --parallel.pp 4 --parallel.zero_stage 1 --train.global_batch 128"
  "zero1-tp8-pp4-dp32:1024:--parallel.tp 8 --parallel.pp 4 --parallel.zero_stage 1 --train.global_batch 256"
)
for model in $MODELS; do
  for rec in $RECOMPUTE; do
    for lay in "${LAYOUTS[@]}"; do
      name=${lay%%:*}; rest=${lay#*:}; world=${rest%%:*}; args=${rest#*:}
      tag="$model-$name-$rec"
      [ -s "$OUT/$tag.json" ] && continue
      start=$(date +%s.%N)
      # shellcheck disable=SC2086
      /usr/bin/time -f "%M" -o "$OUT/$tag.rss" $ZT dryrun --config configs/dryrun_llama3_8b.toml --world "$world" \
          --model.preset "$model" --train.activation_checkpointing "$rec" $args --gpu-mem 80GB \
          --json "$OUT/$tag.json" > "$OUT/$tag.log" || true
      end=$(date +%s.%N)
      echo "$tag wall $(echo "$end - $start" | bc) s maxrss $(tail -1 "$OUT/$tag.rss") KB" >> "$OUT/time.log"
    done
  done
done
${PYTHON:-.venv/bin/python} benchmarks/dryrun_table.py "$OUT"
