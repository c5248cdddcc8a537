#!/usr/bin/env bash
# timm's launcher shape: ./distributed_train.sh N <imgtrain train args>
# STUB until the distributed issue lands: imgtrain has no multi-process training yet, so this
# refuses N > 1 instead of silently training N independent copies.
set -euo pipefail
n=${1:?usage: ./distributed_train.sh N <imgtrain train args>}
shift
if [[ $n != 1 ]]; then
  echo "distributed_train.sh: multi-process training is not implemented yet (asked for $n processes)" >&2
  exit 2
fi
exec "$(dirname "${BASH_SOURCE[0]}")/build/bin/imgtrain" train "$@"
