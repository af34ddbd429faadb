#!/bin/bash
# The inference-layout comparison of `zerotron bench generate` on GPUs (NCCL, one GPU per rank):
# GPT-2 124M shape with random weights (the timings depend on the shapes only), 32 prompts x 100
# new tokens. Not yet run: no GPU was lent to this work. Needs N >= 2 GPUs (pp-tp: N >= 4).
set -euo pipefail
N=${N:-$(python -c "import torch; print(torch.cuda.device_count())")}
zerotron bench generate --nproc "$N" --device cuda --preset gpt2 --vocab-size 50257 --rounds 3 \
    --layouts single,dp,naive-mp,pp,pp-m4,tp,pp-tp,pp-nocache \
    --json benchmarks/generate_gpu.json --markdown benchmarks/generate_gpu.md --plot benchmarks/generate_gpu.png
