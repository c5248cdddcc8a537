#!/usr/bin/env bash
# Peak resident memory of a CPU training benchmark, imgtrain against timm in Python on the same
# torch: the maximum RSS that /usr/bin/time reports for each whole process (the Python side
# includes the interpreter and its imports), alternating runs, medians and the ratio.
#   bench/peak_memory.sh [RUNS] -- <benchmark flags, e.g. --model resnet50 --bench train -b 16 --img-size 160>
# IMGTRAIN_EXTRA="--fuse-bn ..." adds flags to imgtrain's command only.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}; shift || true
[[ ${1:-} == -- ]] && shift
rss() { /usr/bin/time -v "$@" 2>&1 >/dev/null | awk -F': ' '/Maximum resident set size/ {print $2}'; }
declare -a ours ref
for ((r = 0; r < runs; r++)); do
  # shellcheck disable=SC2086  # IMGTRAIN_EXTRA: flags for imgtrain only, as in compare_benchmark.sh
  ours+=("$(rss "$here/build/bin/imgtrain" benchmark --device cpu "$@" ${IMGTRAIN_EXTRA:-})")
  ref_script=$here/bench/timm_benchmark.py
  [[ " $* " == *rcnn* ]] && ref_script=$here/bench/torchvision_detection.py  # a detector: torchvision's
  ref+=("$(rss "$here/.venv/bin/python" "$ref_script" "$@")")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
mo=$(median "${ours[@]}"); mr=$(median "${ref[@]}")
printf 'peak RSS  imgtrain %.0f MiB   reference %.0f MiB   ratio %.3f   (median of %d)\n' \
  "$(awk -v a="$mo" 'BEGIN {print a / 1024}')" "$(awk -v a="$mr" 'BEGIN {print a / 1024}')" \
  "$(awk -v a="$mo" -v b="$mr" 'BEGIN {print a / b}')" "$runs"
