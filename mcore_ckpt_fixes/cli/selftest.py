"""``selftest``: run every fix's round trips on this stack, with the fix off and on, and say what happened.

For each registered fix: whether this release needs it (the engine's verdict with default flags,
as ``status`` shows it), then per scenario its fix declares (:mod:`mcore_ckpt_fixes.testing`) one
world with the fix off (``MCORE_CKPT_FIXES=off``, or on for only the fixes the scenario needs
``alongside``: on a release that needs the fix the documented bug must show) and one with it on (every tensor must come back exactly on every rank). Exit 0 only when every
fix this release needs (or might need: its state could not be decided) has run every scenario
exactly with the fix on; a skipped scenario is never a pass. Fixes registered but not implemented
yet are listed as such and are not checked.

``--device cpu``: gloo worlds of ranks forked from this (warm) process, with the CPU shims applied
in the ranks only. ``--device cuda``: NCCL worlds, one GPU per rank (forked from here where a fork can still use
the GPU, else spawned workers). The CUDA
path has not been run on a GPU by this project's CI (its hosts have none): it is written to the
same contract, and says what it skipped and why.

The user's ``MCORE_CKPT_FIX*`` flags are set aside here (and said so): the selftest compares each
fix at its default (``auto``) with the fix off, whatever this shell has set.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.engine.version import detect

from .selftest_judge import NEEDED_BY_STATE, NOT_APPLICABLE, expected_off, passes, verdict
from .selftest_render import print_table
from .selftest_run import captured, gpus_short, prepare, progress, run_scenario, set_aside_user_flags, stack


def run(device: str = "cpu", nproc=None, as_json: bool = False, only=None) -> int:
    from mcore_ckpt_fixes.testing import for_fix

    info = detect()
    if info.source == "absent":
        print("mcore-ckpt-fixes selftest: Megatron-Core is not importable in this environment", file=sys.stderr)
        return 2
    set_aside = set_aside_user_flags()
    if set_aside:
        progress(
            "selftest: ignoring "
            + ", ".join(f"{k}={v}" for k, v in set_aside.items())
            + ": each fix runs at its default (auto) and off",
            "\n",
        )
    torch_version, stack_skip = stack(device, nproc)
    if torch_version is None:
        print(f"mcore-ckpt-fixes selftest: {stack_skip}", file=sys.stderr)
        return 2

    # ``only`` (``--fix``): these fixes' rows and round trips, the others left out of the verdict too.
    fixes = {k: f for k, f in ENGINE.discover().items() if only is None or k in only}
    began = time.monotonic()
    fd, log_path = tempfile.mkstemp(prefix="mcore-ckpt-fixes-selftest-", suffix=".log")
    os.close(fd)
    with captured(log_path):
        # Defaults, now that the user's flags are set aside (probes of modules already imported
        # run here: their warnings go to the log too).
        mcore_ckpt_fixes.revert()
        mcore_ckpt_fixes.apply()
        progress(f"selftest: importing Megatron-Core {info.version} and the fixes' targets ...", "\n")
        problems = prepare([s for f in fixes.values() if f.implemented for s in for_fix(f.id)])
        from .status import import_targets

        import_targets()
        report = {r["id"]: r for r in mcore_ckpt_fixes.report()}
        rows = [_entry(fix, report[fix.id], info, torch_version, device, nproc) for fix in fixes.values()]
        runnable = [(e, s) for e, f in zip(rows, fixes.values()) if f.implemented for s in for_fix(f.id)]
        for i, (entry, scenario) in enumerate(runnable, 1):
            progress(f"selftest [{i}/{len(runnable)}] {scenario.id}: ")
            result = _run_one(entry, scenario, stack_skip, problems, device, nproc, info.version)
            entry["scenarios"].append(result)
            entry["seconds"] = round(entry["seconds"] + result["seconds"], 1)

    for entry in rows:
        entry["verdict"] = verdict(entry)
    code = 0 if all(passes(e) for e in rows) else 1
    total = time.monotonic() - began
    if code == 0:
        os.unlink(log_path)
    else:
        progress(f"selftest: what the ranks and Megatron printed is in {log_path}", "\n")
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows, info, torch_version, device, nproc, code, total, only)
    return code


def _entry(fix, row, info, torch_version, device, nproc) -> dict:
    """One fix's JSON object, before its scenarios run: the engine's verdict with default flags."""
    return {
        "id": fix.id,
        "summary": fix.summary,
        "implemented": fix.implemented,
        "state": row["state"],
        "reason": row["reason"],
        "affected": fix.affected,
        "in_affected_range": info.version in fix.specifiers if info.version else None,
        "needed": NEEDED_BY_STATE.get(row["state"]) if fix.implemented else None,
        "megatron_core": row["megatron_core"],
        "megatron_source": row["megatron_source"],
        "torch": torch_version,
        "device": device,
        "nproc": nproc,
        "scenarios": [],
        "seconds": 0.0,
    }


def _skip_reason(entry, scenario, stack_skip, problems, device, nproc):
    """Why ``scenario`` cannot run on this stack (None: it can); checked before any world starts."""
    if stack_skip:  # the stack itself cannot run any scenario (no CUDA, no gloo ...): say that
        return stack_skip
    if entry["state"] == "not-applicable":  # nothing to build: the patched feature is absent
        return f"{NOT_APPLICABLE}{entry['reason']}"
    absent = scenario.absent()
    if absent:
        return f"{NOT_APPLICABLE}{absent}"
    if device not in scenario.devices:
        return f"not written for --device {device}"
    if nproc is not None and nproc != scenario.nproc:
        return f"written for exactly {scenario.nproc} ranks; --nproc {nproc} asked"
    if gpus_short(device, scenario.nproc):
        return gpus_short(device, scenario.nproc)
    if scenario.prepare in problems:
        kind, why = problems[scenario.prepare]
        return why if kind == "skip" else None
    return None


def _run_one(entry, scenario, stack_skip, problems, device, nproc, version) -> dict:
    """One scenario's JSON object: skipped (and why), not run (its prepare hook failed), or both halves."""
    from mcore_ckpt_fixes.testing.launcher import run_world

    base = {
        "name": scenario.name,
        "func": scenario.func,
        "nproc": scenario.nproc,
        "doc": scenario.doc,
        "expected_with_fix_off": expected_off(scenario, entry["needed"], version),
    }
    skip = _skip_reason(entry, scenario, stack_skip, problems, device, nproc)
    if skip:
        progress(f"skipped: {skip}", "\n")
        return dict(base, skipped=skip, reproduced=None, exact=None, seconds=0.0)
    if scenario.prepare in problems:  # prepare raised something other than a missing module
        why = problems[scenario.prepare][1]
        progress(f"NOT RUN: {why}", "\n")
        return dict(base, skipped=None, reproduced=None, exact=False, seconds=0.0, error=why)
    return dict(base, **run_scenario(scenario, entry["needed"], device, scenario.nproc, run_world, version))
