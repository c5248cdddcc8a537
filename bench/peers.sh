#!/usr/bin/env bash
# Issue 17's comparison: `imgtrain benchmark` against every configuration of timm a user could pick
# on the same machine, torch and threads, in one run, alternating, medians:
#   imgtrain             (its defaults: inference with BatchNorm folded; training with the fused
#                         kernels where train defaults to them on the CPU: ResNet, EfficientNet,
#                         MobileNetV3, ConvNeXt)
#   imgtrain unfused     (--fuse-bn=false: torch's modules, inference and training)
#   timm eager           (bench/timm_benchmark.py, timm benchmark.py's measurement)
#   timm eager + malloc  (the same with the process settings imgtrain makes at start-up: its glibc
#                         malloc settings as environment variables, and on an AMD CPU MKL's Intel
#                         code paths through a preloaded mkl_serv_intel_cpu_true, built here with cc)
#   timm compiled        (torch.compile default mode, with those settings)
# and the ratio of imgtrain to the best peer.
#   bench/peers.sh [RUNS] -- <benchmark flags with --bench inference or --bench train>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-3}; shift || true
[[ ${1:-} == -- ]] && shift
py=$here/.venv/bin/python
bin=$here/build/bin/imgtrain
malloc=(env MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824)
# imgtrain answers MKL's vendor question itself (apps/imgtrain/commands.cpp): the peers get the same
# answer, or their GEMMs would run MKL's generic AVX2 kernels where imgtrain's run AVX-512.
if grep -q '^vendor_id.*AuthenticAMD' /proc/cpuinfo 2>/dev/null; then
  shim_dir=$(mktemp -d)
  trap 'rm -rf "$shim_dir"' EXIT
  echo 'int mkl_serv_intel_cpu_true(void) { return 1; }' > "$shim_dir/shim.c"
  cc -shared -fPIC -O2 -o "$shim_dir/libmklintel.so" "$shim_dir/shim.c" ||
    { echo "peers.sh: cc could not build the MKL shim for the peers" >&2; exit 2; }
  malloc+=(LD_PRELOAD="$shim_dir/libmklintel.so")
fi
mode=train
[[ " $* " == *" --bench inference "* ]] && mode=infer
[[ " $* " == *" --bench both "* ]] && { echo "peers.sh: one of --bench inference / --bench train" >&2; exit 2; }
field() { sed -n '/^--result/,$p' | sed 1d | "$py" -c "import json,sys; s = sys.stdin.read(); print(json.loads(s).get('${mode}_samples_per_sec', '') if s.strip() else '')"; }
# A command that fails or refuses (e.g. --fuse-bn training with --amp) prints no result: its cell
# stays empty and the last line of its error output is shown.
err=$(mktemp)
trap 'rm -f "$err"' EXIT
cell() {  # NAME COMMAND...: the command's samples/s, or empty with its last error line on stderr
  local name=$1 out
  shift
  out=$("$@" 2>"$err" | field) || out=
  [[ -n $out ]] || echo "peers.sh: $name gave no result: $(grep -v '^\s*$' "$err" | tail -n 1)" >&2
  printf '%s' "$out"
}
names=(imgtrain imgtrain_unfused timm_eager timm_eager_malloc timm_compiled)
declare -A vals
for ((r = 0; r < runs; r++)); do
  for n in "${names[@]}"; do
    case $n in
      imgtrain) v=$(cell $n "$bin" benchmark --device cpu "$@") ;;
      imgtrain_unfused) v=$(cell $n "$bin" benchmark --device cpu "$@" --fuse-bn=false) ;;
      timm_eager) v=$(cell $n "$py" "$here/bench/timm_benchmark.py" "$@") ;;
      timm_eager_malloc) v=$(cell $n "${malloc[@]}" "$py" "$here/bench/timm_benchmark.py" "$@") ;;
      timm_compiled) v=$(cell $n "${malloc[@]}" "$py" "$here/bench/timm_benchmark.py" "$@" --torchcompile) ;;
    esac
    vals[$n]+="$v "
  done
done
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
best=0 best_name=
for n in "${names[@]}"; do
  m=$(median "${vals[$n]}")
  printf '%-18s %9s samples/s  (runs: %s)\n' "$n" "$m" "${vals[$n]% }"
  if [[ $n == timm_* ]] && awk -v a="$m" -v b="$best" 'BEGIN {exit !(a > b)}'; then best=$m best_name=$n; fi
done
ours=$(median "${vals[imgtrain]}")
if [[ -z $ours || -z $best_name ]]; then
  echo "peers.sh: no ratio: $([[ -z $ours ]] && echo imgtrain || echo every peer) gave no result" >&2
  exit 1
fi
printf 'imgtrain / best peer (%s): %.3f\n' "$best_name" "$(awk -v a="$ours" -v b="$best" 'BEGIN {print a / b}')"
