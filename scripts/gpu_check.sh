#!/usr/bin/env bash
# The GPU check (issue 15): one script for a GPU machine without network, run from the repository
# root. It builds imgtrain against that machine's own LibTorch (python3's torch) with the Debian
# build dependencies carried in .gpu-bundle/, runs the CUDA tests, trains a few steps, and
# benchmarks imgtrain against timm on the same GPU, side by side. Everything lands in a markdown
# report, $OUT/gpu_check.md (default: ./gpu-check-out/), written as it goes: a run cut short still
# reports what it reached; the commands' whole output goes to $OUT/gpu_check.log and scratch
# files (data, runs, results) to $WORK (/tmp/gpu-check).
#
#   scripts/gpu_check.sh pack      here, online: download the .deb files into .gpu-bundle/debs
#   scripts/gpu_check.sh verify    here: configure against the bundle alone and list what it lacks
#   scripts/gpu_check.sh [run]     on the GPU machine (carry .gpu-bundle): build, test, benchmark
#
# Knobs (environment): PYTHON (python3: the one with torch, timm, torchvision), OUT, JOBS (all
# cores), ARCH (TORCH_CUDA_ARCH_LIST; default: the GPU's own), SUITE (bench/suites/gpu.yaml: what
# is benchmarked), ONLY (entries of it, e.g. "resnet50 efficientnet_b0"), BENCH_ARGS (flags added
# to every benchmark command, e.g. "-b 128"), REPEATS (1 round), SKIP_BUILD=1 (reuse build-gpu/),
# DEADLINE (540 s: later steps are reported as not run), GIT_COMMIT (the commit to name, also in
# the benchmark records; .git may not travel); for a dry run of the script's later stages on a CPU machine: DEVICE=cpu
# TRAIN_MODEL=resnet18 TRAIN_SIZE=64 ONLY=resnet50 BENCH_ARGS="-b 2 --img-size 64 --num-warm-iter 1
# --num-bench-iter 2".
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
mode=${1:-run}
bundle=$here/.gpu-bundle
PYTHON=${PYTHON:-python3}

# Debian (bookworm) packages the build needs beyond a compiler, CMake, ninja and LibTorch: the
# headers and CMake/pkg-config files (-dev) and the shared libraries they link, down to the
# libraries those need (OpenCV core: BLAS/LAPACK, TBB, GLX). imgcodecs stays out (GDAL).
packages=(
  catch2 libcxxopts-dev nlohmann-json3-dev libfmt-dev libfmt9 libyaml-cpp-dev libyaml-cpp0.7
  libturbojpeg0-dev libturbojpeg0 libjpeg62-turbo-dev libjpeg62-turbo libgif-dev libgif7 zlib1g-dev
  libopencv-core-dev libopencv-core406 libopencv-imgproc-dev libopencv-imgproc406
  libtbb12 libblas3 liblapack3 libgfortran5 libquadmath0 libglx0 libglvnd0 libx11-6 libxcb1 libxau6 libxdmcp6
  libbsd0 libmd0 pkgconf pkgconf-bin libpkgconf3 zlib1g libgloo-dev
)

unpack() {  # extract the bundle into .gpu-bundle/root (never /) and point the tools at it
  local root=$bundle/root lib
  if [[ ! -d $root/usr ]]; then
    mkdir -p "$root"
    for f in "$bundle"/debs/*.deb; do dpkg-deb -x "$f" "$root" || dpkg -x "$f" "$root"; done
  fi
  lib=$root/usr/lib/x86_64-linux-gnu
  # BLAS/LAPACK are found through Debian's alternatives, which extraction does not set up
  [[ -e $lib/libblas.so.3 ]] || ln -sf blas/libblas.so.3 "$lib/libblas.so.3"
  [[ -e $lib/liblapack.so.3 ]] || ln -sf lapack/liblapack.so.3 "$lib/liblapack.so.3"
  # Absolute links (libz.so -> /lib/...) point into the bundle, not at the host's files
  find "$root" -type l -lname '/*' | while read -r l; do
    t=$(readlink "$l"); [[ -e $root$t ]] && ln -sfn "$root$t" "$l" || rm -f "$l"
  done
  # nccl.h: the toolkit's, else the one of torch's own NCCL wheel (appended: the toolkit wins)
  if [[ ! -f /usr/local/cuda/include/nccl.h ]]; then
    local inc
    inc=$("$PYTHON" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "nccl", "include"))' 2>/dev/null)
    [[ -n $inc && -f $inc/nccl.h ]] && export CPATH_APPEND=$inc
  fi
  export BUNDLE_ROOT=$root
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export CPATH=$root/usr/include:$root/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}
  export PKG_CONFIG_SYSROOT_DIR=$root
  export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$root/usr/share/pkgconfig
  export PATH=$PATH:$root/usr/bin
  [[ -n ${CPATH_APPEND:-} ]] && export CPATH=$CPATH:$CPATH_APPEND
  if ! command -v pkg-config >/dev/null; then
    mkdir -p "$bundle/bin" && ln -sf "$root/usr/bin/pkgconf" "$bundle/bin/pkg-config" && export PATH=$bundle/bin:$PATH
  fi
}

configure() {  # configure build dir $1 against the bundle and python3's LibTorch
  local dir=$1; shift
  local torch_prefix
  torch_prefix=$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || return 1
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DIMGTRAIN_WITH_IMGCODECS=OFF \
    -DCMAKE_PREFIX_PATH="$BUNDLE_ROOT/usr;$torch_prefix" -DCMAKE_INCLUDE_PATH="$BUNDLE_ROOT/usr/include" \
    -DCMAKE_LIBRARY_PATH="$BUNDLE_ROOT/usr/lib/x86_64-linux-gnu" -DIMGTRAIN_TEST_PYTHON="$(command -v "$PYTHON")" "$@"
}

case $mode in
pack)
  mkdir -p "$bundle/debs"
  (cd "$bundle/debs" && apt-get download "${packages[@]}") || { echo "gpu_check: apt-get download failed (apt-get update first?)" >&2; exit 1; }
  rm -rf "$bundle/root"
  du -sh "$bundle/debs"
  exit 0 ;;
verify)
  # Everything the configure step finds must come from the bundle or LibTorch, not from this
  # machine's /usr (which the GPU machine lacks); the bundle's libraries must resolve among themselves.
  [[ -d $bundle/debs ]] || { echo "gpu_check: no bundle; run scripts/gpu_check.sh pack" >&2; exit 1; }
  rm -rf "$bundle/root"; unpack
  configure /tmp/gpu-check-verify -DIMGTRAIN_CUDA=OFF >/tmp/gpu-check-verify.log 2>&1 || { tail -30 /tmp/gpu-check-verify.log; exit 1; }
  bad=$(grep -E '^[A-Za-z_]+(_DIR|_INCLUDE|_LIBRARY|_CORE|_IMGPROC|INCLUDE_DIR)[A-Za-z_]*:(PATH|FILEPATH)=/usr/' /tmp/gpu-check-verify/CMakeCache.txt |
        grep -v -E 'CUDA|Torch|Caffe2|kineto|Python|/usr/local/cuda' || true)
  pc=$(pkg-config --cflags --libs libturbojpeg libjpeg 2>&1)
  missing=$(for f in $(find "$BUNDLE_ROOT" -name '*.so*' -type f); do ldd "$f" 2>/dev/null | grep 'not found'; done | sort -u)
  outside=$(for f in $(find "$BUNDLE_ROOT" -name '*.so*' -type f); do ldd "$f" 2>/dev/null | awk '/=> \// {print $3}'; done | sort -u |
            grep -v "^$BUNDLE_ROOT" | grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libz|ld-linux-x86-64|libpthread|libdl|librt)\.so' || true)
  echo "found outside the bundle: ${bad:-none}"
  echo "pkg-config: $pc"
  echo "unresolved libraries: ${missing:-none}"
  echo "bundle libraries resolved outside it (beyond glibc, libstdc++, zlib): ${outside:-none}"
  du -sh "$bundle/debs" "$BUNDLE_ROOT"
  # (pkgconf leaves out -I of directories already on CPATH; the libraries' paths are checked above)
  [[ -z $bad && -z $missing && -z $outside ]] && pkg-config --exists libturbojpeg libjpeg && echo "bundle: complete" && exit 0
  exit 1 ;;
run) ;;
*) echo "usage: scripts/gpu_check.sh [pack|verify|run]" >&2; exit 2 ;;
esac

OUT=${OUT:-$here/gpu-check-out}
mkdir -p "$OUT"
report=$OUT/gpu_check.md
log=$OUT/gpu_check.log
: >"$log"
start=$(date +%s)
note() { echo "$*" | tee -a "$report"; }
elapsed() { echo "$(( $(date +%s) - start )) s"; }
# step NAME CMD...: runs CMD with its output in the log, notes pass/fail and the time in the
# report (quiet_step: in the log only)
DEADLINE=${DEADLINE:-540}  # seconds from the start: later steps are reported as not run
quiet_step() {
  local name=$1; shift
  local t0=$(date +%s) rc left
  left=$(( DEADLINE - (t0 - start) ))
  if (( left < 10 )); then echo "=== $name: not run (deadline ${DEADLINE} s)" >>"$log"; return 124; fi
  echo "=== $name: $*" >>"$log"
  if [[ $(type -t "$1") == function ]]; then "$@" >>"$log" 2>&1; rc=$?
  else timeout -k 10 "$left" "$@" >>"$log" 2>&1; rc=$?; fi
  echo "=== $name: exit $rc in $(( $(date +%s) - t0 )) s" >>"$log"
  return $rc
}
step() {
  local name=$1 t0=$(date +%s) rc
  quiet_step "$@"; rc=$?
  local how="FAILED (exit $rc)"
  [[ $rc == 0 ]] && how=ok
  [[ $rc == 77 && ${DEVICE:-cuda} != cuda ]] && how="skipped (exit 77: no GPU)"
  [[ $rc == 124 ]] && how="not finished (deadline ${DEADLINE} s)"
  note "- $name: $how in $(( $(date +%s) - t0 )) s"
  return $rc
}

export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{
  echo "# imgtrain GPU check"
  echo
  echo "- commit $GIT_COMMIT, $(date -u +%FT%TZ)"
  echo "- nvcc: $(command -v nvcc || echo none); toolkit headers: $(ls /usr/local/cuda/include 2>/dev/null | grep -E '^(nccl|cudnn)\.h$' | tr '\n' ' ')"
  echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "- torch: $("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)," \
       "timm $("$PYTHON" -c 'import timm; print(timm.__version__)' 2>&1 | tail -1), nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*')"
  echo "- CPU cores: $(nproc)"
  echo
  echo "## Build and tests"
} >"$report"

unpack
export JOBS=${JOBS:-$(nproc)}
if [[ -z ${ARCH:-} ]]; then
  ARCH=$("$PYTHON" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")' 2>/dev/null || echo 9.0)
fi
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  step "configure (TORCH_CUDA_ARCH_LIST $ARCH)" configure build-gpu -DIMGTRAIN_CUDA=ON -DTORCH_CUDA_ARCH_LIST="$ARCH" ||
    { tail -40 "$log"; exit 1; }
  step "build imgtrain" cmake --build build-gpu -j "$JOBS" --target imgtrain -- -k 0 || { tail -60 "$log"; exit 1; }
  step "build unit_tests, parity_tests" cmake --build build-gpu -j "$JOBS" --target unit_tests parity_tests -- -k 0
fi
bin=build-gpu/bin
step "CUDA unit tests (unit_tests [cuda])" $bin/unit_tests "[cuda]" --durations yes
step "references for the device kernels (torchvision)" "$PYTHON" tests/parity/make_ops_refs.py build-gpu/parity_refs/ops
step "CUDA kernels against torchvision (parity_tests [cuda])" $bin/parity_tests "[cuda]" --durations yes
note "- build and tests done at $(elapsed)"

# A few training steps through the whole engine on the GPU: JPEG folder, loader, AMP, channels-last.
work=${WORK:-/tmp/gpu-check}
mkdir -p "$work"
data=$work/data
"$PYTHON" - "$data" >>"$log" 2>&1 <<'EOF'
import os, sys, numpy as np
from PIL import Image
root = sys.argv[1]
rng = np.random.default_rng(0)
for split, n in (("train", 256), ("validation", 64)):
    for c in range(4):
        d = os.path.join(root, split, f"class{c}")
        os.makedirs(d, exist_ok=True)
        for i in range(n // 4):
            img = (rng.random((256, 256, 3)) * 60 + c * 50).astype(np.uint8)
            Image.fromarray(img).save(os.path.join(d, f"{i}.jpg"), quality=90)
EOF
DEVICE=${DEVICE:-cuda}
TRAIN_MODEL=${TRAIN_MODEL:-resnet50}
TRAIN_SIZE=${TRAIN_SIZE:-224}
{ echo; echo "## Training ($TRAIN_MODEL, $TRAIN_SIZE px, batch 64, 4 classes of synthetic JPEGs, 4 updates an epoch)"; } >>"$report"
train_flags=(--data-dir "$data" --model "$TRAIN_MODEL" --num-classes 4 -b 64 --epochs 1 --img-size "$TRAIN_SIZE" -j 8 --device "$DEVICE"
             --amp --amp-dtype bfloat16 --channels-last --log-interval 1 --output "$work/runs")
step "train 1 epoch, --amp bf16 --channels-last" build-gpu/bin/imgtrain train "${train_flags[@]}" --experiment bf16
step "train 1 epoch, --amp fp16 (loss scaler) --model-ema" build-gpu/bin/imgtrain train "${train_flags[@]/bfloat16/float16}" --model-ema --experiment fp16
step "resume the fp16 run for one more epoch" build-gpu/bin/imgtrain train "${train_flags[@]/bfloat16/float16}" --model-ema \
  --experiment fp16 --resume auto --epochs 2
grep -h -E "Train: |Test: |samples/s|error|warning" "$work"/runs/*/log.txt 2>/dev/null | tail -12 | sed 's/^/    /' >>"$report"

# imgtrain against timm on the same GPU, driven by the benchmark suite file (bench/suites/gpu.yaml,
# the same bench/ci_bench.py that runs the CPU suite of .ci/bench): per entry imgtrain, imgtrain
# --cuda-graph, timm eager, then timm compiled at the end of the round. The records land in
# $OUT/gpu_bench.json as they are measured; a command that fails or is cut by the deadline is a
# "failed" cell and the rest still run.
SUITE=${SUITE:-bench/suites/gpu.yaml}
REPEATS=${REPEATS:-1}
{
  echo
  echo "## Throughput: imgtrain against timm ($SUITE${ONLY:+, only $ONLY}${BENCH_ARGS:+, with $BENCH_ARGS}, $REPEATS round(s))"
  echo
} >>"$report"
bench_left=$(( DEADLINE - ($(date +%s) - start) - 15 ))
quiet_step "benchmark suite" "$PYTHON" bench/ci_bench.py run --suite "$SUITE" --device "$DEVICE" --repeats "$REPEATS" \
  --imgtrain build-gpu/bin/imgtrain --keep-going --deadline "$bench_left" ${ONLY:+--only "$ONLY"} \
  ${BENCH_ARGS:+--extra-args="$BENCH_ARGS"} --out "$OUT/gpu_bench.json"
if [[ -s $OUT/gpu_bench.json ]]; then
  "$PYTHON" bench/ci_bench.py table "$OUT/gpu_bench.json" >>"$report" 2>>"$log" || note "- (no table: see gpu_check.log)"
else
  note "- benchmark suite: no records (see gpu_check.log)"
fi
note ""
note "Total: $(elapsed). Commands and full output: gpu_check.log."
cat "$report"
