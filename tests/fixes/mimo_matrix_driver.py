"""Run a batch of mimo-optimizer save or load worlds in *this* environment; tests/fixes/test_mimo_matrix.py
starts it once per release environment (``python mimo_matrix_driver.py JOBS.json OUT.json``).

JOBS.json: ``[{"mode": "save" | "load", "ckpt_dir": str, "patched": bool, "sharding_type": ...}, ...]``
(``sharding_type``: one inner optimizer type or ``{module: type}``; default ``dp_reshardable``). Each job is one
world of 2 forked ranks (language on rank 0, vision on rank 1) running
``mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core:save_only`` / ``load_only``, the fix on or off in the
ranks (``MCORE_CKPT_FIXES=off``). Megatron-Core is imported once here, so every world starts warm.
OUT.json: per job, the Megatron-Core version and one entry per rank (the scenario's result dict, or
the rank's traceback when it produced none).
"""

import json
import math
import os
import sys

KEEP = (
    "error",
    "phase",
    "rank_errors",
    "max_delta",
    "n_tensors",
    "bad_groups",
    "sharding_type",
    "warnings",
    "fix_state",
    "module",
    "traceback",
    "steps",
)


def _plain(value):
    """JSON-safe copy of a scenario result (inf deltas become the string "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(jobs_path, out_path):
    from mcore_ckpt_fixes.engine.version import detect
    from mcore_ckpt_fixes.testing.launcher import run_world
    from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core import prepare

    prepare()
    version = str(detect().version)
    with open(jobs_path) as f:
        jobs = json.load(f)
    out = []
    for job in jobs:
        func = {"save": "save_only", "load": "load_only"}[job["mode"]]
        os.makedirs(job["ckpt_dir"], exist_ok=True)
        results = run_world(
            f"mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core:{func}",
            2,
            {
                "ckpt_dir": job["ckpt_dir"],
                "patched": job["patched"],
                "sharding_type": job.get("sharding_type", "dp_reshardable"),
            },
            env={} if job["patched"] else {"MCORE_CKPT_FIXES": "off"},
            timeout=job.get("timeout", 120),
        )
        ranks = []
        for r in results:
            if r.ok:
                ranks.append({"ok": True, **{k: _plain(r.value.get(k)) for k in KEEP}})
            else:
                ranks.append({"ok": False, "crash": r.error})
        out.append({"job": job, "version": version, "ranks": ranks})
        with open(out_path, "w") as f:  # written after every world: a killed batch keeps the finished ones
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
