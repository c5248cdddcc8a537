#!/usr/bin/env bash
# The per-family table of docs/performance.md: training steps (forward, backward, optimizer step)
# at batch 8, 224 px on the CPU, imgtrain against timm in eager Python on the same torch and
# threads, medians of alternating runs (bench/compare_benchmark.sh).
#   bench/family_table.sh [RUNS]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}
for m in resnet50 mobilenetv3_large_100 efficientnet_b0 vit_small_patch16_224 convnext_tiny; do
  printf '%-24s ' "$m"
  "$here/bench/compare_benchmark.sh" "$runs" -- --model "$m" --bench train -b 8 --img-size 224 \
    --num-warm-iter 2 --num-bench-iter 8 | grep '^train'
done
