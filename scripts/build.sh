#!/usr/bin/env bash
# Configures (once) and builds imgtrain into build/; the binary lands at build/bin/imgtrain.
# Extra arguments go to cmake's configure step, e.g. scripts/build.sh -DIMGTRAIN_CUDA=OFF;
# IMGTRAIN_TARGET=imgtrain builds only the binary (the main job does).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
mkdir -p build
if [[ ! -f build/CMakeCache.txt || $# -gt 0 ]]; then
  if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >build/configure.log 2>&1; then
    cat build/configure.log; exit 1
  fi
fi
cmake --build build -j "${IMGTRAIN_JOBS:-2}" ${IMGTRAIN_TARGET:+--target "$IMGTRAIN_TARGET"}
