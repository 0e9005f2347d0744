#!/usr/bin/env bash
# Run the test suite on every Megatron-Core release line (or the ones named), building the cached
# environments first. Exit status is non-zero if any line fails.
#
#   tools/test.sh                 # whole matrix: 0.16.1 0.17.1 0.18.2 0.19.2 (and 0.15.3, the framework
#                                 # lines, status on every release), in two streams at once
#   tools/test.sh 0.18.2          # one release line
#   tools/test.sh 0.16.1 -- -k tp_group   # extra pytest arguments after --
#   tools/test.sh 0.15.3 -- tests/patches # any release of tools/sweep-releases.txt (not the default matrix)
#   tools/test.sh fw-verl         # one framework line: tests/frameworks with verl installed beside its
#                                 # Megatron-Core line (tools/frameworks.txt); its tests fail, not skip,
#                                 # when the framework does not import there
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Outside the clone by default, so a fresh clone (CI) on a machine that built them reuses them.
ENVS=${MCORE_CKPT_FIXES_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore-ckpt-fixes/envs}

releases=(); pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; pytest_args=("$@"); break; fi
  releases+=("$1"); shift
done
explicit=${releases[*]:-}
if [ ${#releases[@]} -eq 0 ]; then
  mapfile -t releases < <(awk '!/^#/ && NF {print $1}' tools/releases.txt)
  mapfile -t -O ${#releases[@]} releases < <(awk '!/^#/ && NF {print "fw-" $1}' tools/frameworks.txt)
fi

tools/envs.sh "${releases[@]}" || { echo "test.sh: building environments failed" >&2; exit 2; }

framework_line() {  # fw-NAME [pytest args] -> exit status of tests/frameworks in that framework's env,
  local name=${1#fw-} rels rel py start rc=0 one; shift          # once per Megatron-Core line it names
  rels=$(awk -v n="$name" '$1==n {print $2; exit}' tools/frameworks.txt)
  local args=("$@"); [ ${#args[@]} -gt 0 ] || args=(tests/frameworks)
  for rel in ${rels//,/ }; do
    py=$(awk -v r="$rel" '$1==r {print $2; exit}' tools/releases.txt tools/sweep-releases.txt)
    echo "=== $name (tools/frameworks/$name.txt) on Megatron-Core $rel (Python $py) ==="
    start=$(date +%s)
    PYTHONPATH="$ENVS/fw-$name:$ENVS/mcore-$rel:$ROOT" PYTHONDONTWRITEBYTECODE=1 MCORE_CKPT_FIXES_FRAMEWORK="$name" \
      "$ENVS/py$py/bin/python" -m pytest -p no:cacheprovider --durations=15 "${args[@]}"
    one=$?
    echo "=== $name on $rel: exit $one in $(( $(date +%s) - start )) s ==="
    [ $one -eq 0 ] || rc=$one
  done
  return $rc
}

# Tests marked one_line prove nothing about the Megatron-Core release that other tests do not prove
# on every line (the engine's import-order mechanics with a probe fix of the tests' own, the world
# launcher, selftest's full run, whose round trips the fix tests run on each line): the whole matrix
# runs them on this one line only. A line run alone (tools/test.sh 0.16.1) runs them.
ONE_LINE=$(awk '!/^#/ && $3=="one-line" {print $1; exit}' tools/releases.txt)

# --durations=15: each line's log ends with its 15 slowest tests, what CI's time budget is spent on.
release_line() {  # RELEASE -> exit status of the suite on that Megatron-Core line
  local rel=$1 py select only paths expr id start rc
  py=$(awk -v r="$rel" '$1==r {print $2; exit}' tools/releases.txt tools/sweep-releases.txt)
  select=()
  if [ -z "$explicit" ] && [ ${#pytest_args[@]} -eq 0 ] && [ "$rel" != "$ONE_LINE" ]; then
    select=(-m "not gpu and not one_line")
  fi
  only=$(awk -v r="$rel" '$1==r && $3 ~ /^fixes=/ {sub(/^fixes=/, "", $3); print $3; exit}' tools/releases.txt)
  if [ -n "$only" ] && [ ${#pytest_args[@]} -eq 0 ]; then
    # Only these fixes' tests: each fix's own file, its source diffs and its lifecycle.
    paths=(tests/patches tests/engine/test_lifecycle.py tests/fixes/test_every_fix.py); expr=""
    for id in ${only//,/ }; do
      paths+=("tests/fixes/test_${id//-/_}.py"); expr+="${expr:+ or }${id//-/_} or $id"
    done
    select=(-m "not gpu" "${paths[@]}" -k "$expr")
  fi
  echo "=== Megatron-Core $rel (Python $py)${select[*]:+, one-line tests on $ONE_LINE only} ==="
  start=$(date +%s)
  PYTHONPATH="$ENVS/mcore-$rel:$ROOT" PYTHONDONTWRITEBYTECODE=1 \
    "$ENVS/py$py/bin/python" -m pytest -p no:cacheprovider --durations=15 "${select[@]}" "${pytest_args[@]}"
  rc=$?
  echo "=== Megatron-Core $rel: exit $rc in $(( $(date +%s) - start )) s ==="
  return $rc
}

run_line() {
  case "$1" in
    fw-*) framework_line "$1" "${pytest_args[@]}" ;;
    *) release_line "$1" ;;
  esac
}

# The whole matrix runs its lines in two streams at once (MCORE_CKPT_FIXES_TEST_STREAMS, default 2;
# 1: one after the other): most of a line's time is one Python process, so a second line uses the
# second core. Each line's log is printed whole as soon as it ends. The streams are balanced by each
# line's minutes in a recent CI run (LINE_MINUTES; a line not listed counts 1).
declare -A LINE_MINUTES=([0.19.2]=23 [0.18.2]=21 [0.17.1]=15 [0.16.1]=8 [0.15.3]=1 [0.14.0]=1 [0.13.1]=1
  [fw-ms-swift]=2 [fw-megatron-bridge]=2 [fw-verl]=1 [fw-megatron-fsdp]=1 [fw-nemo-toolkit]=1)
STREAMS=${MCORE_CKPT_FIXES_TEST_STREAMS:-2}
failed=()
if [ -z "$explicit" ] && [ ${#pytest_args[@]} -eq 0 ] && [ "$STREAMS" -gt 1 ]; then
  logs=$(mktemp -d)
  declare -a load=() members=()
  for ((i = 0; i < STREAMS; i++)); do load[i]=0; members[i]=""; done
  # Heaviest line first, each to the stream with the least so far.
  for rel in $(for r in "${releases[@]}"; do echo "${LINE_MINUTES[$r]:-1} $r"; done | sort -rn | awk '{print $2}'); do
    best=0
    for ((i = 1; i < STREAMS; i++)); do [ "${load[i]}" -lt "${load[best]}" ] && best=$i; done
    load[best]=$(( load[best] + ${LINE_MINUTES[$rel]:-1} )); members[best]+="$rel "
  done
  for ((i = 0; i < STREAMS; i++)); do
    echo "test.sh: stream $((i + 1)): ${members[i]}(about ${load[i]} min)"
    (
      for rel in ${members[i]}; do
        run_line "$rel" > "$logs/$rel.log" 2>&1
        echo $? > "$logs/$rel.rc"
        flock "$logs/.print" cat "$logs/$rel.log"
      done
    ) &
  done
  wait
  for rel in "${releases[@]}"; do
    [ "$(cat "$logs/$rel.rc" 2>/dev/null)" = 0 ] || failed+=("$rel")
  done
  rm -rf "$logs"
else
  for rel in "${releases[@]}"; do
    run_line "$rel" || failed+=("$rel")
  done
fi
# Every published release, quickly: each fix's state as measured (tools/expected-status.json), none
# failed. Only with the whole matrix (no release named).
if [ -z "$explicit" ] && [ ${#pytest_args[@]} -eq 0 ]; then
  echo "=== status on every release (tools/status_check.py) ==="
  start=$(date +%s)
  "$ENVS/py3.12/bin/python" tools/status_check.py || failed+=("status-check")
  echo "=== status check: $(( $(date +%s) - start )) s ==="
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: FAILED on ${failed[*]}" >&2
  exit 1
fi
echo "test.sh: all release lines passed (${releases[*]})"
