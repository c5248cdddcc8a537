#!/usr/bin/env bash
# The training loop's step time, two builds side by side: alternating runs of the README job's
# first epoch, each stopped after the `Train: 0 [ 300/468` line, whose running average it prints.
#   bench/loop_step_pairs.sh BEFORE_BIN AFTER_BIN [PAIRS]   (e.g. a worktree of an older commit)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
before=${1:?usage: loop_step_pairs.sh BEFORE_BIN AFTER_BIN [PAIRS]}
after=${2:?usage: loop_step_pairs.sh BEFORE_BIN AFTER_BIN [PAIRS]}
pairs=${3:-6}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {
  local bin=$1 out=$tmp/$2
  rm -rf "$out"; mkdir -p "$out"
  "$bin" train -c "$here/configs/fashion_mnist.yaml" --epochs 1 --warmup-epochs 0 --output "$out" --experiment e \
    >"$out/run.log" 2>&1 &
  local pid=$!
  while ! grep -q 'Train: 0 \[ 300/468' "$out/run.log" 2>/dev/null; do
    sleep 1
    kill -0 "$pid" 2>/dev/null || break
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  grep 'Train: 0 \[ 300/468' "$out/run.log" | sed 's/.*(\([0-9.]*\)s, *[0-9.]*\/s).*/\1/'
}
for ((p = 0; p < pairs; p++)); do
  if ((p % 2 == 0)); then b=$(run "$before" b); a=$(run "$after" a); else a=$(run "$after" a); b=$(run "$before" b); fi
  awk -v p="$p" -v b="$b" -v a="$a" 'BEGIN { printf "pair %d (%s first): before %s s  after %s s  ratio %.3f\n", p + 1, p % 2 ? "after" : "before", b, a, a / b }'
done
