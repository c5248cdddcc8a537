#!/usr/bin/env bash
# The input pipeline side by side: `imgtrain benchmark --bench data` against torchvision's
# ImageFolder + DataLoader (PIL) on the same JPEGs with the same transforms (RandomResizedCrop with
# bilinear interpolation, horizontal flip, uint8 batches), workers and batch size; alternating runs,
# medians, ratio. The images (photo-like, JPEG q90, ~500x375) are generated on the first run.
#   bench/data_vs_torchvision.sh [RUNS] [-- -j 1 -b 64 --img-size 224]
# IMGTRAIN_BENCH_MODE=eval compares the eval pipelines instead (`--bench data-eval` against
# Resize + CenterCrop; IMGTRAIN_BENCH_FLAGS adds imgtrain-only flags such as --fast-decode).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}; shift || true
[[ ${1:-} == -- ]] && shift
args=("$@"); [[ ${#args[@]} -eq 0 ]] && args=(-j 1 -b 64 --img-size 224)
py=$here/.venv/bin/python
data=${IMGTRAIN_BENCH_DATA:-$here/build/bench-jpeg-2000}
"$py" "$here/bench/torchvision_data.py" --data-dir "$data" --make 2000 >/dev/null
field() { sed -n '/^--result/,$p' | sed 1d | "$py" -c "import json,sys; d=json.load(sys.stdin); print(d.get('$1', ''))"; }
declare -a ours ref
for ((r = 0; r < runs; r++)); do
  if [[ ${IMGTRAIN_BENCH_MODE:-train} == eval ]]; then
    o=$("$here/build/bin/imgtrain" benchmark --bench data-eval --data-dir "$data" --interpolation bilinear \
        --num-warm-iter 2 --num-bench-iter 20 ${IMGTRAIN_BENCH_FLAGS:-} "${args[@]}" 2>/dev/null)
    t=$("$py" "$here/bench/torchvision_data.py" --mode eval --data-dir "$data" --num-warm-iter 2 --num-bench-iter 20 \
        "${args[@]}" 2>/dev/null)
  else
    o=$("$here/build/bin/imgtrain" benchmark --bench data --data-dir "$data" --train-interpolation bilinear \
        --num-warm-iter 2 --num-bench-iter 20 ${IMGTRAIN_BENCH_FLAGS:-} "${args[@]}" 2>/dev/null)
    t=$("$py" "$here/bench/torchvision_data.py" --data-dir "$data" --num-warm-iter 2 --num-bench-iter 20 "${args[@]}" 2>/dev/null)
  fi
  ours+=("$(field data_samples_per_sec <<<"$o")"); ref+=("$(field data_samples_per_sec <<<"$t")")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
mo=$(median "${ours[@]}"); mr=$(median "${ref[@]}")
printf 'images/s (%s)  imgtrain %8.1f   torchvision %8.1f   ratio %.2f   (median of %d)\n' "${args[*]}" "$mo" "$mr" \
  "$(awk -v a="$mo" -v b="$mr" 'BEGIN {print a / b}')" "$runs"
