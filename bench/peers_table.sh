#!/usr/bin/env bash
# Issue 17's whole table (docs/performance.md): bench/peers.sh for each model's training step and
# inference at batch 8, 224 px, two threads, one cell after the other, and a markdown row per cell
# (imgtrain's median and runs, imgtrain --fuse-bn=false, the three timm peers, imgtrain / best peer).
# Channels-last for the families whose CPU training defaults to it (resnet50, efficientnet_b0,
# mobilenetv3_large_100; timm gets the same flag); ConvNeXt and ViT NCHW. ~40 minutes at RUNS=3.
#   bench/peers_table.sh [RUNS] [MODEL...]     (default: the five models of the issue, both steps)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}; shift || true
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(resnet50 efficientnet_b0 mobilenetv3_large_100 convnext_tiny vit_small_patch16_224)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
echo "| model, step | imgtrain (runs) | imgtrain \`--fuse-bn=false\` | timm eager | eager + malloc | torch.compile | imgtrain / best peer |"
echo "|---|---|---|---|---|---|---|"
for step in train inference; do
  for m in "${models[@]}"; do
    flags=(--model "$m" --bench "$step" -b 8 --img-size 224 --num-warm-iter 2)
    case $m in resnet*|efficientnet*|mobilenetv3*) flags+=(--channels-last) ;; esac
    if [[ $step == train ]]; then flags+=(--num-bench-iter 6)
    elif [[ $m == vit* ]]; then flags+=(--num-bench-iter 8)
    else flags+=(--num-bench-iter 10); fi
    out=$("$here/bench/peers.sh" "$runs" -- "${flags[@]}")
    # peers.sh prints "<name> <median> samples/s  (runs: ...)" per configuration, then the ratio
    col() { awk -v n="$1" '$1 == n && $3 == "samples/s" {print $2}' <<<"$out"; }
    runs_of() { awk -v n="$1" '$1 == n && $3 == "samples/s" {sub(/.*runs: /, ""); sub(/\)$/, ""); gsub(/ /, ", "); print}' <<<"$out"; }
    ratio=$(awk '/^imgtrain \/ best peer/ {print $NF}' <<<"$out")
    echo "| $m, $step | $(col imgtrain) ($(runs_of imgtrain)) | $(col imgtrain_unfused) | $(col timm_eager) |" \
      "$(col timm_eager_malloc) | $(col timm_compiled) | $ratio |"
  done
done
