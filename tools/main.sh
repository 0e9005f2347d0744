#!/usr/bin/env bash
# The main job on a fresh machine: install mcore-ckpt-fixes (built as a wheel from this checkout)
# beside a default Megatron-Core (0.16.1 on Python 3.11 with the CPU torch wheel: the quickest
# stack to build here) and run the selftest on CPU with gloo: which fixes this release needs, the
# bug with each fix off, the exact round trip with it on.
#   tools/main.sh [RELEASE]       e.g. tools/main.sh 0.18.2 (any release of tools/releases.txt or tools/sweep-releases.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Outside the clone by default, so a fresh clone (CI) on a machine that built them reuses them.
ENVS=${MCORE_CKPT_FIXES_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore-ckpt-fixes/envs}
rel=${1:-0.16.1}
tools/envs.sh "$rel"
py=$(awk -v r="$rel" '$1==r {print $2; exit}' tools/releases.txt tools/sweep-releases.txt)
app="$ENVS/app-$rel"
rm -rf "$app"
"$ENVS/py$py/bin/python" -m pip install -q --no-deps --no-build-isolation --target "$app" "$ROOT"
# Run the installed copy, not the source tree: from another directory, without it on the path.
cd "$(mktemp -d)"
PYTHONPATH="$app:$ENVS/mcore-$rel" "$ENVS/py$py/bin/python" -m mcore_ckpt_fixes selftest --device cpu
