#!/usr/bin/env bash
# The whole GPU check, in one command, on a GPU host prepared by tools/gpu_prepare.sh (run from the
# repository root there, .gpu carried): for each release line's wheel, every scenario registered for
# CUDA (tests/gpu/test_cuda_round_trips.py, both halves, one world per half for a fix's batch), the
# catalogued bugs only a GPU shows (tests/gpu/test_cuda_known_bugs.py) and, on every line that ships
# megatron.training (0.17.0 on), the resume check on CUDA (tests/gpu/test_cuda_resume.py), as jobs
# side by side, within a time budget (default 540 s, so the check ends inside a 10-minute command).
# Writes to OUT (default .gpu/out):
#   device.json    the device, driver, torch and CUDA versions
#   results.jsonl  one line per scenario and release line: both halves' outcome per rank
#   <line>.xml     pytest's JUnit report per line (<line>-resume.xml: the resume check), and its
#                  log (<line>.log); summary.json: each test's outcome per line, and the jobs that
#                  did not finish (the budget ran out, or the wheel did not install)
#   GPU_CHECK_ARCHIVE=FILE  also packs OUT into one .tar.gz (a device run that returns few files)
# Exit 0 when every test that ran passed.
#
# GPU_CHECK_DEVICE=cpu rehearses the whole check on a host without a GPU (python3 a Python 3.12 with
# torch; the same wheels, worlds, batches and judgement on CPU ranks): run it before a GPU host's
# time is spent, so that what fails there is what only a GPU shows.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-.gpu/out}}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
export MCORE_CKPT_FIXES_GPU_TEST_DEVICE=${GPU_CHECK_DEVICE:-cuda}
# A round-trip world that hangs (a rank stopped before a collective) is cut off after this long, so
# that it costs its scenarios and not the rest of its line (the CPU rehearsal's worlds took about 6 s
# on average, seven jobs sharing two cores).
export MCORE_CKPT_FIXES_GPU_WORLD_TIMEOUT_S=${GPU_CHECK_WORLD_TIMEOUT_S:-150}
mkdir -p "$OUT"
start=$(date +%s)
python3 - > "$OUT/device.json" <<'PY'
import json, os, subprocess, torch
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
except OSError as exc:  # no driver on this host
    smi = [f"nvidia-smi: {exc}"]
print(json.dumps({"device": os.environ["MCORE_CKPT_FIXES_GPU_TEST_DEVICE"], "gpus": smi, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                  "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}))
PY
wheels=(.gpu/wheels/megatron_core-*.whl)
rc=0
left=()
# Each line's wheel in its own folder first (local wheels: seconds), then every line's tests at once:
# a line is mostly its worlds' start-up on the CPU cores, and the host has cores to spare, so the
# lines run side by side (each line's resume check as a job of its own) rather than
# one after another. Each job has the whole budget; one that runs out is named in summary.json.
jobs=()
for whl in "${wheels[@]}"; do
  rel=$(basename "$whl" | sed 's/megatron_core-\([^-]*\)-.*/\1/')
  site=/tmp/mcore-gpu-$rel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$whl" \
    || { rc=1; left+=("$rel"); continue; }
  jobs+=("$rel:$rel:tests/gpu/test_cuda_round_trips.py tests/gpu/test_cuda_known_bugs.py")
  # The resume check needs megatron.training, in the wheel from 0.17.0 (0.16.1 would only skip it).
  [ "$(printf '%s\n' 0.17.0 "$rel" | sort -V | head -1)" = 0.17.0 ] && jobs+=("$rel:$rel-resume:tests/gpu/test_cuda_resume.py")
done
pids=()
for job in "${jobs[@]}"; do
  IFS=: read -r rel name tests <<< "$job"
  left_s=$(( BUDGET - ($(date +%s) - start) ))
  echo "=== Megatron-Core $rel: $tests (log $OUT/$name.log, $left_s s) ==="
  # PYTORCH_NVML_BASED_CUDA_CHECK: torch.cuda.is_available() in the parent asks NVML, not the CUDA
  # driver, so that its worlds can be forked (testing/launcher.py, cuda_method).
  PYTHONPATH="/tmp/mcore-gpu-$rel:$PWD" MCORE_CKPT_FIXES_GPU_RESULTS="$OUT/results.jsonl" PYTHONUNBUFFERED=1 \
    PYTORCH_NVML_BASED_CUDA_CHECK=1 \
    timeout "$left_s" python3 -m pytest -p no:cacheprovider -m gpu -q -rA $tests \
    --junitxml "$OUT/$name.xml" > "$OUT/$name.log" 2>&1 &
  pids+=("$!")
done
for i in "${!pids[@]}"; do
  IFS=: read -r rel name tests <<< "${jobs[$i]}"
  wait "${pids[$i]}"; status=$?
  [ $status -eq 0 ] || rc=1
  [ $status -eq 124 ] && left+=("$name")  # the budget ran out: its JUnit report is missing
  echo "--- $name: exit $status"; tail -n 15 "$OUT/$name.log"
done
python3 - "$OUT" "${left[@]}" > "$OUT/summary.json" <<'PY'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out, left = sys.argv[1], sys.argv[2:]
summary = {"lines": {}, "not_finished": left}
for path in sorted(glob.glob(os.path.join(out, "*.xml"))):
    rows = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        rows[f"{case.get('classname')}::{case.get('name')}"] = kind
    summary["lines"][os.path.basename(path)[:-4]] = rows
print(json.dumps(summary, indent=1))
PY
echo "gpu_check: exit $rc after $(( $(date +%s) - start )) s; results in $OUT (not finished: ${left[*]:-none})"
# One archive of OUT for a host that hands back only a few files (the device tool: eight).
if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then
  tar czf "$GPU_CHECK_ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "gpu_check: archive $GPU_CHECK_ARCHIVE"
fi
exit $rc
