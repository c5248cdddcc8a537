#!/usr/bin/env bash
# Data-parallel step time across two "hosts" (network namespaces joined by a veth pair shaped to a
# cluster-like bandwidth) against the same two processes on one host (loopback), alternating.
# Needs root and iproute2. Usage:
#   sudo bench/two_hosts.sh [RATE=10gbit] [MODEL=resnet50] [REPEATS=2] [extra benchmark flags...]
# Prints, per configuration and repeat, train_step_time (ms) and allreduce_ms (one plain all-reduce
# of the gradient bytes, measured by the benchmark), and for the two hosts the share of their extra
# all-reduce time (over loopback's) hidden behind backward: 1 - (step_veth - step_lo) / (ar_veth - ar_lo).
# Both configurations run 2 processes on this machine's cores, so only the network path differs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${IMGTRAIN_BIN:-$here/build/bin/imgtrain}
rate=${1:-10gbit}
model=${2:-resnet50}
repeats=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
common=(benchmark --bench train --model "$model" -b 8 --img-size 160 --device cpu --num-warm-iter 3
        --num-bench-iter 10 "$@")
tag=$$
a=itb-a$tag b=itb-b$tag
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$a"; ip netns add "$b"
ip link add va$tag type veth peer name vb$tag
ip link set va$tag netns "$a"; ip link set vb$tag netns "$b"
ip -n "$a" addr add 198.18.0.1/30 dev va$tag; ip -n "$b" addr add 198.18.0.2/30 dev vb$tag
for n in "$a" "$b"; do ip -n "$n" link set lo up; done
ip -n "$a" link set va$tag up; ip -n "$b" link set vb$tag up
# netem where the kernel has it, else a token bucket (tbf) at the same rate.
shaped="unshaped"
for q in "netem rate $rate" "tbf rate $rate burst 1mb latency 50ms"; do
  if ip netns exec "$a" tc qdisc add dev va$tag root $q 2>/dev/null &&
     ip netns exec "$b" tc qdisc add dev vb$tag root $q 2>/dev/null; then
    shaped="$q"
    break
  fi
  ip netns exec "$a" tc qdisc del dev va$tag root 2>/dev/null || true
done
echo "# $model, veth $shaped; 1 thread per process; $(nproc) cores"

field() { grep -o "\"$1\": [0-9.]*" | head -1 | awk '{print $2}'; }
one_node() { OMP_NUM_THREADS=1 "$bin" "${common[@]}" --nproc-per-node 2 2>/dev/null; }
two_hosts() {
  local port=$((29700 + RANDOM % 200)) out
  OMP_NUM_THREADS=1 ip netns exec "$a" "$bin" "${common[@]}" --nproc-per-node 1 --nnodes 2 --node-rank 0 \
    --master-addr 198.18.0.1 --master-port $port > /tmp/two_hosts.$tag.a 2>/dev/null &
  OMP_NUM_THREADS=1 ip netns exec "$b" "$bin" "${common[@]}" --nproc-per-node 1 --nnodes 2 --node-rank 1 \
    --master-addr 198.18.0.1 --master-port $port > /dev/null 2>&1
  wait
  cat /tmp/two_hosts.$tag.a; rm -f /tmp/two_hosts.$tag.a
}
single() { OMP_NUM_THREADS=1 "$bin" "${common[@]}" 2>/dev/null; }

printf "%-22s %8s %14s %12s %8s\n" config repeat train_step_ms allreduce_ms hidden
for r in $(seq "$repeats"); do
  s=$(single | field train_step_time)
  printf "%-22s %8s %14s %12s %8s\n" "1 process" "$r" "$s" "-" "-"
  for cfg in one_node two_hosts; do
    out=$($cfg)
    t=$(echo "$out" | field train_step_time); ar=$(echo "$out" | field allreduce_ms)
    if [[ $cfg == one_node ]]; then
      t_lo=$t; ar_lo=$ar; hid="-"; name="1 node x 2 (loopback)"
    else
      hid=$(awk -v t="$t" -v s="$t_lo" -v a="$ar" -v b="$ar_lo" 'BEGIN { if (a > b) printf "%.2f", 1 - (t - s) / (a - b); else print "-" }')
      name="2 hosts x 1 (veth)"
    fi
    printf "%-22s %8s %14s %12s %8s\n" "$name" "$r" "$t" "$ar" "$hid"
  done
done
