#!/usr/bin/env bash
# `imgtrain benchmark` with two builds (or two wrappers adding flags) side by side: ROUNDS rounds,
# the order A B then B A, every step's ms/step kept; prints each side's minimum and median step and
# B's speed over A's by both. On a noisy machine the minimum shows what a change can do and the
# median what it usually does; where they disagree, there is no verdict.
#   OMP_NUM_THREADS=2 bench/step_pairs.sh ROUNDS A_BIN B_BIN -- <benchmark flags>
set -euo pipefail
usage="usage: step_pairs.sh ROUNDS A_BIN B_BIN -- <imgtrain benchmark flags>"
rounds=${1:?$usage}
a=${2:?$usage}
b=${3:?$usage}
[[ ${4:-} == -- ]] || { echo "$usage" >&2; exit 2; }
shift 4
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "step_pairs.sh: ROUNDS must be a positive number: $rounds" >&2; exit 2; }
for bin in "$a" "$b"; do [[ -x $bin ]] || { echo "step_pairs.sh: not an executable: $bin" >&2; exit 2; }; done
steps=$(mktemp)
trap 'rm -f "$steps"' EXIT
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then order=(A B); else order=(B A); fi
  for side in "${order[@]}"; do
    if [[ $side == A ]]; then bin=$a; else bin=$b; fi
    out=$("$bin" benchmark --device cpu "$@" 2>&1) || { echo "step_pairs.sh: $bin failed:" >&2; echo "$out" | tail -5 >&2; exit 1; }
    grep -o '[0-9.]* ms/step' <<<"$out" | awk -v s="$side" '{print s, $1}' >>"$steps"
  done
done
python3 - "$steps" <<'PY'
import statistics, sys
d = {}
for line in open(sys.argv[1]):
    side, ms = line.split()
    d.setdefault(side, []).append(float(ms))
if set(d) != {"A", "B"}:
    sys.exit("step_pairs.sh: no ms/step lines from one side")
for k in ("A", "B"):
    print(f"{k}: min {min(d[k]):.1f} ms, median {statistics.median(d[k]):.1f} ms, {len(d[k])} steps")
print(f"B / A speed: {min(d['A']) / min(d['B']):.3f} by the minimum, "
      f"{statistics.median(d['A']) / statistics.median(d['B']):.3f} by the median")
PY
