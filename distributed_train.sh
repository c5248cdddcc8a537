#!/usr/bin/env bash
# timm's launcher shape: ./distributed_train.sh N <imgtrain train args>
# N worker processes on this machine (imgtrain's own torchrun-compatible launcher).
set -euo pipefail
n=${1:?usage: ./distributed_train.sh N <imgtrain train args>}
shift
exec "$(dirname "${BASH_SOURCE[0]}")/build/bin/imgtrain" train --nproc-per-node "$n" "$@"
