"""Import cost of ``mcore_ckpt_fixes`` relative to ``import megatron.core``, measured in one run.

Each import runs in a fresh interpreter (N times, median), minus the cost of an empty interpreter.
Goal: ratio under 1 %. Also checks that importing the fixes alone loads neither torch nor megatron.

    PYTHONPATH=.envs/mcore-0.16.1:. .envs/py3.11/bin/python benchmarks/import_overhead.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _time(code: str, runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    base = _time("pass", args.runs)
    ours = _time("import mcore_ckpt_fixes", args.runs) - base
    megatron = _time("import megatron.core", args.runs) - base
    heavy = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, mcore_ckpt_fixes; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'numpy'}))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    result = {
        "runs": args.runs,
        "interpreter_s": round(base, 4),
        "import_mcore_ckpt_fixes_s": round(ours, 4),
        "import_megatron_core_s": round(megatron, 4),
        "ratio": round(ours / megatron, 5),
        "goal_ratio_below": 0.01,
        "heavy_modules_after_import": heavy,
    }
    print(json.dumps(result, indent=2))
    return 0 if heavy == "[]" else 1


if __name__ == "__main__":
    sys.exit(main())
