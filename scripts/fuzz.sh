#!/usr/bin/env bash
# Builds the libFuzzer harnesses (clang, ASan + UBSan) into build-fuzz/ and runs each for a set
# time, starting from the seeds in tests/fuzz/corpus/<harness> (the growing corpus is kept in
# build-fuzz/corpus/<harness>, so the repository's seeds stay small).
#   scripts/fuzz.sh [SECONDS_PER_HARNESS] [HARNESS ...]     (default: 60 s, all harnesses)
#   IMGTRAIN_FUZZ_RUNS=10000000 scripts/fuzz.sh 7200 tar    (stop at that many executions, or the time)
# One line per harness: executions, corpus size, and "ok" or the finding (crash-* file kept in
# build-fuzz/findings/<harness>/). Exit status 1 when any harness found something.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
seconds=${1:-60}
shift || true
all=(safetensors torch_save config idx tar image coco_json)
harnesses=("${@:-${all[@]}}")
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ is needed (Debian: apt-get install clang); scripts/setup.sh --fuzz installs it" >&2
  exit 2
fi
mkdir -p build-fuzz
if [[ ! -f build-fuzz/CMakeCache.txt ]]; then
  if ! cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
      -DIMGTRAIN_FUZZ=ON -DIMGTRAIN_TESTS=OFF -DIMGTRAIN_CUDA=OFF >build-fuzz/configure.log 2>&1; then
    cat build-fuzz/configure.log; exit 1
  fi
fi
cmake --build build-fuzz -j "${IMGTRAIN_JOBS:-2}" --target imgtrain_fuzzers
# Leak checks off: LibTorch's one-time registrations read as leaks in an uninstrumented library.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for h in "${harnesses[@]}"; do
  corpus=build-fuzz/corpus/$h findings=build-fuzz/findings/$h
  mkdir -p "$corpus" "$findings"
  log=build-fuzz/fuzz-$h.log
  rc=0
  max_len=65536
  [[ $h == config ]] && max_len=4096  # config files are small; long inputs only slow the search
  build-fuzz/bin/fuzz_$h -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -max_len=$max_len \
    ${IMGTRAIN_FUZZ_RUNS:+-runs=$IMGTRAIN_FUZZ_RUNS} \
    -print_final_stats=1 -artifact_prefix="$findings/" "$corpus" "tests/fuzz/corpus/$h" >"$log" 2>&1 || rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  units=$(ls "$corpus" | wc -l)
  secs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | grep -o '[0-9]* second' | grep -o '[0-9]*' || echo "$seconds")
  if [[ $rc -eq 0 ]]; then
    echo "fuzz_$h: ok, $execs executions in ${secs:-$seconds} s, corpus $units"
  else
    status=1
    what=$(grep -m1 -E 'ERROR: (AddressSanitizer|libFuzzer)|runtime error:|fuzz finding:' "$log" || tail -n 1 "$log")
    echo "fuzz_$h: FINDING after $execs executions: $what (log $log, input in $findings/)"
  fi
done
exit $status
