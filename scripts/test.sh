#!/usr/bin/env bash
# README command 2: set up (with the Python reference tools), build, run the whole test suite.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh" --test
"$here/scripts/build.sh"
cd "$here/build"
ctest --output-on-failure -j "${IMGTRAIN_TEST_JOBS:-2}" "$@"
