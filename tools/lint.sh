#!/usr/bin/env bash
# ruff lint and format check over the repository (configured in pyproject.toml), with the ruff of
# the cached Python 3.12 test environment (tools/requirements-test.txt pins it). Exit non-zero on
# any finding.
#   tools/lint.sh            # check
#   tools/lint.sh --fix      # apply ruff's safe fixes and format in place
set -euo pipefail
cd "$(dirname "$0")/.."
ENVS=${MCORE_CKPT_FIXES_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore-ckpt-fixes/envs}
tools/envs.sh 0.19.2 >/dev/null || { echo "lint.sh: building the Python 3.12 environment failed" >&2; exit 2; }
ruff=("$ENVS/py3.12/bin/python" -m ruff)
if [ "${1:-}" = "--fix" ]; then
  "${ruff[@]}" check --fix .
  "${ruff[@]}" format .
  exit 0
fi
"${ruff[@]}" check .
"${ruff[@]}" format --check .
echo "lint.sh: ruff check and format check passed"
