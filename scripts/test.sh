#!/usr/bin/env bash
# README command 2: set up (with the Python reference tools), build, run the whole test suite.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh" --test
"$here/scripts/build.sh"
cd "$here/build"
rc=0
ctest --output-on-failure -j "${IMGTRAIN_TEST_JOBS:-2}" "$@" || rc=$?
# The smoke fuzz run (the whole suite only, not a selection): each libFuzzer harness for
# IMGTRAIN_FUZZ_SECONDS (default 20; 0 skips it) from its seeds, ASan + UBSan (scripts/fuzz.sh).
if [[ $# -eq 0 && ${IMGTRAIN_FUZZ_SECONDS:-20} != 0 ]]; then
  echo "test: smoke fuzz run, ${IMGTRAIN_FUZZ_SECONDS:-20} s per harness (scripts/fuzz.sh)"
  "$here/scripts/fuzz.sh" "${IMGTRAIN_FUZZ_SECONDS:-20}" || rc=1
fi
exit $rc
