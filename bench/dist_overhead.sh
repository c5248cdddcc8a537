#!/usr/bin/env bash
# Data-parallel overhead on the CPU: the per-process train step time of 2 processes x 1 thread
# (Gloo, gradients all-reduced in buckets during backward) against 1 process x 1 thread at the
# same per-process batch, alternating runs, medians. On a 2-core machine two processes also slow
# each other down without any communication (shared memory bandwidth and caches), so the script
# also times 2 independent 1-thread processes running at once: the communication's own cost is the
# DDP step minus that, compared with one plain Gloo all-reduce of the same gradient bytes.
#   bench/dist_overhead.sh [RUNS] -- <benchmark flags, e.g. --model resnet18 -b 16 --img-size 112>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}; shift || true
[[ ${1:-} == -- ]] && shift
py=$here/.venv/bin/python
bin=$here/build/bin/imgtrain
field() { sed -n '/^--result/,$p' | sed 1d | "$py" -c "import json,sys; d=json.load(sys.stdin); print(d.get('$1', ''))"; }
declare -a one two ar pair
for ((r = 0; r < runs; r++)); do
  o=$(OMP_NUM_THREADS=1 "$bin" benchmark --bench train --device cpu "$@" 2>/dev/null)
  t=$(OMP_NUM_THREADS=1 "$bin" benchmark --bench train --device cpu --nproc-per-node 2 "$@" 2>/dev/null)
  tmp=$(mktemp -d)
  OMP_NUM_THREADS=1 "$bin" benchmark --bench train --device cpu "$@" >"$tmp/a" 2>/dev/null &
  OMP_NUM_THREADS=1 "$bin" benchmark --bench train --device cpu "$@" >"$tmp/b" 2>/dev/null
  wait
  pa=$(field train_step_time <"$tmp/a"); pb=$(field train_step_time <"$tmp/b"); rm -rf "$tmp"
  pair+=("$(awk -v a="$pa" -v b="$pb" 'BEGIN {print (a + b) / 2}')")
  one+=("$(field train_step_time <<<"$o")"); two+=("$(field train_step_time <<<"$t")"); ar+=("$(field allreduce_ms <<<"$t")")
  bytes=$(field allreduce_bytes <<<"$t"); buckets=$(field grad_buckets <<<"$t")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
m1=$(median "${one[@]}"); m2=$(median "${two[@]}"); ma=$(median "${ar[@]}"); mp=$(median "${pair[@]}")
awk -v a="$m1" -v b="$m2" -v c="$ma" -v p="$mp" -v n="$bytes" -v k="$buckets" -v r="$runs" 'BEGIN {
  printf "step ms per process (median of %d): 1 proc x 1 thread %.1f; 2 independent procs at once %.1f; 2 procs DDP %.1f\n", r, a, p, b
  printf "DDP vs 1 proc: +%.1f%%; DDP vs 2 independent procs (communication alone): +%.1f%%\n", 100 * (b - a) / a, 100 * (b - p) / p
  printf "gradients %.1f MB in %d buckets; plain Gloo all-reduce of the same bytes %.1f ms (%.2f GB/s algorithm bandwidth)\n", n / 1e6, k, c, n / c / 1e6
  printf "communication cost per step %.1f ms = %.0f%% of the plain all-reduce time\n", b - p, 100 * (b - p) / c
}'
