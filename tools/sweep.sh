#!/usr/bin/env bash
# status and selftest on every published Megatron-Core release (or the ones named), one cached
# environment each, and a table of the results (Markdown, on stdout; per-release JSON in $OUT).
#
#   tools/sweep.sh                      # every release in tools/sweep-releases.txt
#   tools/sweep.sh 0.13.1 0.15.3        # some
#   MCORE_CKPT_FIXES_SWEEP_STATUS_ONLY=1 tools/sweep.sh   # status only (quick)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ENVS=${MCORE_CKPT_FIXES_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore-ckpt-fixes/envs}
OUT=${MCORE_CKPT_FIXES_SWEEP_OUT:-$ROOT/.sweep}
export MCORE_CKPT_FIXES_SWEEP_TORCH=1   # 0.12.x selftests need the older torch its writer expects
mkdir -p "$OUT"

releases=("$@")
[ ${#releases[@]} -gt 0 ] || mapfile -t releases < <(awk '!/^#/ && NF {print $1}' tools/sweep-releases.txt)
tools/envs.sh "${releases[@]}" >&2 || { echo "sweep.sh: building environments failed" >&2; exit 2; }

for rel in "${releases[@]}"; do
  venv=$(awk -v r="$rel" '$1==r {print $3; exit}' tools/sweep-releases.txt)
  py="$ENVS/${venv:-py3.12}/bin/python"
  run() { PYTHONPATH="$ENVS/mcore-$rel:$ROOT" PYTHONDONTWRITEBYTECODE=1 "$py" -m mcore_ckpt_fixes "$@"; }
  echo "sweep.sh: $rel: status" >&2
  run status --json > "$OUT/$rel.status.json" 2>"$OUT/$rel.status.log"
  if [ "${MCORE_CKPT_FIXES_SWEEP_STATUS_ONLY:-}" != 1 ]; then
    echo "sweep.sh: $rel: selftest" >&2
    start=$(date +%s)
    run selftest --json > "$OUT/$rel.selftest.json" 2>"$OUT/$rel.selftest.log"
    echo "{\"exit\": $?, \"seconds\": $(( $(date +%s) - start ))}" > "$OUT/$rel.selftest.exit.json"
  fi
done
"$ENVS/py3.12/bin/python" tools/sweep_table.py "$OUT" "${releases[@]}"
