#!/usr/bin/env bash
# README command 1: set up, build, train the default model on Fashion-MNIST, print the test accuracy.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh"
IMGTRAIN_TARGET=imgtrain "$here/scripts/build.sh"
cd "$here"
exec build/bin/imgtrain train -c configs/fashion_mnist.yaml "$@"
