"""Hunt for a hang in the patched non-colocated MIMO save/load under CPU load (issue: one stall seen).

Runs the registered ``mimo-optimizer/world2`` round trip (and, with ``--world4``, the 4-rank TP=2
variant) RUNS times with the fix on, while LOAD busy-loop processes keep every core saturated.
Each world has a deadline; a rank still running at the deadline is killed, and the stack it dumped
just before (``testing/worker.py``) is printed: the collective where ranks disagree. Exit status
1 when any run stalled or was not exact.

    PYTHONPATH=$E/mcore-0.19.2:. $E/py3.12/bin/python tools/mimo_stress.py [--runs 20] [--load 2] [--world4]
"""

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time


def _busy():
    while True:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=2, help="busy-loop processes (default: one per core here)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--world4", action="store_true", help="the 4-rank TP=2 variant instead of world 2")
    args = ap.parse_args(argv)

    from mcore_ckpt_fixes.testing.launcher import run_world
    from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core import prepare

    prepare()
    nproc = 4 if args.world4 else 2
    hogs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for h in hogs:
        h.start()
    times, bad = [], 0
    try:
        for i in range(args.runs):
            start = time.monotonic()
            results = run_world(
                "mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core:round_trip",
                nproc,
                {"ckpt_dir": tempfile.mkdtemp(prefix="mimo-stress-"), "patched": True},
                timeout=args.timeout,
            )
            took = time.monotonic() - start
            times.append(took)
            problems = [
                r.error if not r.ok else f"rank {r.rank}: {r.value['phase']}: {r.value['error']}"
                for r in results
                if not r.ok or r.value["error"] is not None
            ]
            bad += bool(problems)
            print(f"run {i + 1}/{args.runs}: {'OK' if not problems else 'FAILED'} in {took:.1f} s", flush=True)
            for p in problems:
                print(p, flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(
        f"world {nproc}, {args.runs} runs under {args.load} busy loops: {bad} stalled or failed; "
        f"median {statistics.median(times):.1f} s, max {max(times):.1f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
