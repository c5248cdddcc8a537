#!/usr/bin/env bash
# The sanitizer run: everything built with ASan + UBSan into build-asan/ (gcc, the same compiler
# as the normal build), then the tests that exercise our own code paths hardest. LibTorch and the
# Debian libraries are not instrumented; ASan checks every access our code makes.
#   scripts/sanitize.sh                 the unit tests (labels unit, unit_fault): builds unit_tests only
#   scripts/sanitize.sh -L integration  any ctest selection instead (builds everything)
# A finding stops the test with ASan's / UBSan's report in its output (ctest --output-on-failure).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
"$here/scripts/setup.sh" --test
mkdir -p build-asan
if [[ ! -f build-asan/CMakeCache.txt ]]; then
  if ! cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DIMGTRAIN_SANITIZE=ON -DIMGTRAIN_CUDA=OFF \
      >build-asan/configure.log 2>&1; then
    cat build-asan/configure.log; exit 1
  fi
fi
if [[ $# -eq 0 ]]; then
  cmake --build build-asan -j "${IMGTRAIN_JOBS:-2}" --target unit_tests
else
  cmake --build build-asan -j "${IMGTRAIN_JOBS:-2}"
fi
# Leak checks off: LibTorch's one-time registrations read as leaks in an uninstrumented library.
# new_delete_type_mismatch off: torch's sized deallocations are not instrumented.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:new_delete_type_mismatch=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd build-asan
if [[ $# -eq 0 ]]; then set -- -L '^unit' -E '^test_names_are_whole$'; fi
ctest --output-on-failure -j "${IMGTRAIN_TEST_JOBS:-2}" "$@"
