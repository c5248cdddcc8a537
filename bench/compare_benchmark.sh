#!/usr/bin/env bash
# Side by side, same machine, same torch, same threads: `imgtrain benchmark` against timm in eager
# Python (bench/timm_benchmark.py), or a detector (--model *rcnn*) against torchvision's
# (bench/torchvision_detection.py); alternating runs, medians and the ratio imgtrain / reference.
#   bench/compare_benchmark.sh [RUNS] -- <benchmark flags, e.g. --model resnet50 --bench both -b 8 --img-size 160>
# IMGTRAIN_EXTRA="--fuse-bn ..." adds flags to imgtrain's command only (what the reference has no
# equivalent of); a detector's --pretrained-path W is the reference's --weights W.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}; shift || true
[[ ${1:-} == -- ]] && shift
py=$here/.venv/bin/python
ref_script=$here/bench/timm_benchmark.py ref_name=timm
[[ " $* " == *rcnn* ]] && ref_script=$here/bench/torchvision_detection.py ref_name=torchvision
field() { sed -n '/^--result/,$p' | sed 1d | "$py" -c "import json,sys; d=json.load(sys.stdin); print(d.get('$1', ''))"; }
declare -a ours_i ours_t ref_i ref_t
for ((r = 0; r < runs; r++)); do
  # shellcheck disable=SC2086  # IMGTRAIN_EXTRA is a list of flags
  o=$("$here/build/bin/imgtrain" benchmark --device cpu "$@" ${IMGTRAIN_EXTRA:-} 2>/dev/null)
  t=$("$py" "$ref_script" "$@" 2>/dev/null)
  ours_i+=("$(field infer_samples_per_sec <<<"$o")"); ours_t+=("$(field train_samples_per_sec <<<"$o")")
  ref_i+=("$(field infer_samples_per_sec <<<"$t")"); ref_t+=("$(field train_samples_per_sec <<<"$t")")
done
median() { printf '%s\n' "$@" | { grep -v '^$' || true; } | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
for kind in infer train; do
  if [[ $kind == infer ]]; then mo=$(median "${ours_i[@]}"); mr=$(median "${ref_i[@]}"); else mo=$(median "${ours_t[@]}"); mr=$(median "${ref_t[@]}"); fi
  [[ -z $mo || -z $mr ]] && continue
  printf '%-6s samples/s  imgtrain %8.3f   %s %8.3f   ratio %.3f   (median of %d)\n' "$kind" "$mo" "$ref_name" "$mr" \
    "$(awk -v a="$mo" -v b="$mr" 'BEGIN {print a / b}')" "$runs"
done
