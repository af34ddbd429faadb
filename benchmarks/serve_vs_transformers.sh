#!/usr/bin/env bash
# Reproduce benchmarks/serve_vs_transformers.{json,md} (zerotron serve vs transformers serve
# --continuous-batching over HTTP, 16 and 64 clients) and benchmarks/serve_pool_exhaustion.{json,md}
# (64 clients with long outputs on a pool too small for them all).
# The model: a GPT-2 of 4 layers x 128 wide, context 1024, vocab 512 (configs/tiny.toml's
# tokenizer), trained 2 steps (the weights do not matter for the timings, only the shapes);
# transformers serve loads its `zerotron export` (the same weights).
# Results go to a fresh temporary directory (printed at the end); OUT=benchmarks overwrites the
# committed results.
set -euo pipefail
cd "$(dirname "$0")/.."
ZT=${ZEROTRON:-.venv/bin/zerotron}
OUT=${OUT:-$(mktemp -d -t serve_vs_transformers.XXXXXX)}
RUN=${RUN:-$(mktemp -d -t serve_bench_run.XXXXXX)/run}
mkdir -p "$OUT"
[ -d "$RUN" ] || $ZT train --config configs/tiny.toml --run-dir "$RUN" --model.block_size 1024 --model.n_embd 128 \
    --train.steps 2 --train.micro_batch 1 --train.global_batch 2 --train.eval_every 0 --log.plot false \
    --log.sample_tokens 0 --log.progress false
# the committed run: random prompts, 128 new tokens, one torch thread per server (2 shared cores);
# the full sweep of the issue: --concurrency 1,4,16,64 --workloads random,shared-prefix --max-tokens 256
$ZT bench serve --checkpoint "$RUN" --peer transformers --concurrency 16,64 --workloads random --threads 1 \
    --max-tokens 128 --json "$OUT/serve_vs_transformers.json" --markdown "$OUT/serve_vs_transformers.md"
# pool exhaustion: 1024-token context, 16-token blocks of 64 KiB: 64 blocks hold one full-context row; 256 blocks
# (16 MiB) against ~1,300 blocks that 64 rows of 16..128 + 256 tokens need at their end
$ZT bench serve --checkpoint "$RUN" --peer none --concurrency 64 --workloads random --max-tokens 256 --threads 1 \
    --serve-args="--kv-cache-mb 16" --json "$OUT/serve_pool_exhaustion.json" --markdown "$OUT/serve_pool_exhaustion.md"
echo "written to $OUT"
