#!/usr/bin/env bash
# Installs everything imgtrain needs on a fresh Debian machine; quiet and quick when nothing is missing.
#   scripts/setup.sh          build dependencies (Debian packages, LibTorch from the torch wheel)
#   scripts/setup.sh --test   also the Python reference tools of requirements-test.txt and clang
#                             with libFuzzer (the smoke fuzz run, scripts/fuzz.sh)
# The venv lives outside the clone, keyed by the hash of requirements-build.txt, and ./.venv points
# at it, so a fresh clone (CI) reuses a venv that an earlier clone already installed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
want_test=0
[[ ${1:-} == --test ]] && want_test=1

debs=(build-essential cmake pkg-config ccache python3-venv
      libopencv-core-dev libopencv-imgproc-dev libopencv-imgcodecs-dev libturbojpeg0-dev libjpeg62-turbo-dev libgif-dev
      libyaml-cpp-dev libcxxopts-dev libfmt-dev nlohmann-json3-dev catch2 zlib1g-dev libgloo-dev
      iproute2 dataset-fashion-mnist)
((want_test)) && debs+=(clang libclang-rt-dev)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

py=${IMGTRAIN_PYTHON:-python3}
cache=${IMGTRAIN_CACHE:-$HOME/.cache/imgtrain}
key=$(sha1sum "$here/requirements-build.txt" | cut -c1-12)
venv=$cache/venv-$key
if [[ ! -f $venv/.complete ]]; then
  echo "setup: creating $venv (LibTorch from the torch wheel; several GB, a few minutes)"
  rm -rf "$venv"; mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-build.txt"
  touch "$venv/.complete"
fi
if [[ ! -e $here/.venv || $(readlink -f "$here/.venv") != "$(readlink -f "$venv")" ]]; then
  rm -rf "$here/.venv"; ln -s "$venv" "$here/.venv"
fi
if ((want_test)); then
  tkey=$(sha1sum "$here/requirements-test.txt" | cut -c1-12)
  if [[ ! -f $venv/.test-$tkey ]]; then
    echo "setup: installing the Python reference tools (requirements-test.txt)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-test.txt"
    touch "$venv/.test-$tkey"
  fi
fi
