"""What the fixes' probes and patches add to importing every module they target, as one ratio.

Every sample is a fresh interpreter that runs ``import mcore_ckpt_fixes`` and then imports every
target module of every enabled fix (Megatron-Core's, and a framework's where it is installed),
timed inside the interpreter in CPU seconds (``time.process_time``: what this process spends, not
what other processes on a shared machine take from it). Three kinds, interleaved in every round:

* ``on``: the fixes on (``MCORE_CKPT_FIXES`` unset): each probe runs, and each patch goes in, as its
  module is imported;
* ``off``: the same imports with ``MCORE_CKPT_FIXES=off``;
* ``late``: the imports with the fixes off (the package's import hooks in place, as with them on),
  then ``mcore_ckpt_fixes.apply()`` with them on: every probe and patch, timed apart, after
  everything the imports bring in is there (what a probe imports that the imports would import
  anyway is not counted against it).

    ratio         = median(late apply) / median(late imports)     goal: <= 0.02
    on/off ratio  = median(on) / median(off) - 1, and the median of the paired ratios

The on/off ratio is the same question asked of whole imports; on a busy machine its noise (a few
per cent per sample) is larger than what it measures, so the ``late`` ratio is the figure.

Also fails (exit 1) if an import with the fixes on prints a line that the same import with them
off does not (a library made to print by a probe) or opens a file for writing, creates, renames or
removes one (a probe writing to disk; audited with ``sys.addaudithook``, in samples not timed).

Measured on Megatron-Core 0.19.2 (Python 3.12, CPU-only torch 2.x, 2 cores shared with other jobs;
10 target modules, all seven fixes decided, five applied):

    before (every probe and rebind as in 0.1.0): apply 0.290 s / imports 7.485 s CPU = 3.9 %  (8 rounds)
    now:                                         apply 0.091 s / imports 7.871 s CPU = 1.2 %  (6 rounds)

printed_by_probes and written_by_probes empty now; before, the mimo-optimizer probe's DCP checkpoint
(mkdir, .distcp, .metadata, metadata.json, common.pt) and its two library lines. The on/off
ratio on that machine moved between -5 % and +11 % from one run to the next: noise, not a measure.
(The "now" run shared the machine with a test run: CPU time, not wall time, for that reason.)

    PYTHONPATH=$E/mcore-0.19.2:. $E/py3.12/bin/python benchmarks/probe_overhead.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

# The child: import the package and every target module; report CPU seconds (and, for "late", those
# of apply() apart), the fixes' states and, when audited, what it wrote.
_CHILD = r"""
import importlib, json, os, sys, time, warnings
modules, kind, audit = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "audit"
writes = []
if audit:  # what is opened for writing or created (not timed: the hook slows every import)
    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and (
            any(c in str(args[1] or "") for c in "wax+") or (args[2] or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        ):
            writes.append(f"open {os.fsdecode(args[0])}")
        elif event in ("os.mkdir", "os.rename", "os.remove", "shutil.rmtree"):
            writes.append(f"{event} {args[0]!s}")
    sys.addaudithook(hook)
if kind == "late":
    os.environ["MCORE_CKPT_FIXES"] = "off"
start = time.process_time()
import mcore_ckpt_fixes
if kind == "late":  # the import hooks in place, as where the fixes are on: only apply() is put off
    from mcore_ckpt_fixes.engine import hooks
    hooks.register("megatron", lambda module: None)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the targets' own deprecation warnings are not the probes'
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:
            pass  # not importable here: the same for every kind
imports = time.process_time() - start
apply = 0.0
if kind == "late":
    del os.environ["MCORE_CKPT_FIXES"]
    start = time.process_time()
    mcore_ckpt_fixes.apply()
    apply = time.process_time() - start
states = {r["id"]: r["state"] for r in mcore_ckpt_fixes.report()}
sys.__stdout__.write("\n@@" + json.dumps({"imports": imports, "apply": apply, "states": states, "writes": writes}) + "\n")
"""


def target_modules():
    """Every target module of every enabled fix whose package is installed here."""
    import mcore_ckpt_fixes  # noqa: F401  (applies: the engine knows the enabled fixes)
    from mcore_ckpt_fixes.engine.registry import ENGINE

    return sorted({module for _, module in ENGINE.enabled_target_modules(installed_only=True)})


def sample(modules, kind: str, audit: bool = False):
    """(the child's report, the lines it printed) for one fresh interpreter."""
    # Bytecode caches are written and used, as for an installed package (the first sample writes them).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCORE_CKPT_FIX", "PYTHONDONTWRITEBYTECODE"))}
    if kind == "off":
        env["MCORE_CKPT_FIXES"] = "off"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(modules), kind, "audit" if audit else "time"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    noise, _, payload = proc.stdout.rpartition("\n@@")
    return json.loads(payload), (noise + proc.stderr).splitlines()


def _anonymous(path: str) -> str:
    """``path`` without tempfile's random names (torch's own import probes the temporary directory
    with one), so that the same write on both sides compares equal."""
    return re.sub(r"[a-z0-9_]{8}(?=$|/|\.)", "*", path)


def side_effects(modules):
    """What an import with the fixes on prints and writes that the same import with them off does not."""
    on, on_output = sample(modules, "on", audit=True)
    off, off_output = sample(modules, "off", audit=True)
    # Lines compared without their digits (times, process ids); this package's own log lines are
    # not a library's chatter.
    off_lines = {re.sub(r"\d+", "#", line) for line in off_output}
    printed = sorted(
        line for line in on_output if re.sub(r"\d+", "#", line) not in off_lines and "mcore_ckpt_fixes" not in line
    )
    off_writes = {_anonymous(path) for path in off["writes"]}
    written = sorted(path for path in on["writes"] if _anonymous(path) not in off_writes)
    return on["states"], printed, written


def ratios(on, off, late_imports, late_apply):
    median = statistics.median
    return {
        "late_imports_cpu_s": round(median(late_imports), 4),
        "late_apply_cpu_s": round(median(late_apply), 4),
        "ratio": round(median(late_apply) / median(late_imports), 4),
        "on_cpu_s": round(median(on), 4),
        "off_cpu_s": round(median(off), 4),
        "on_off_ratio": round(median(on) / median(off) - 1, 4),
        "on_off_paired_ratio": round(median([a / b - 1 for a, b in zip(on, off)]), 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    modules = target_modules()
    for kind in ("on", "off"):
        sample(modules, kind)  # writes this package's bytecode caches, warms the file cache
    states, printed, written = side_effects(modules)
    on, off, late_imports, late_apply = [], [], [], []
    order = ("on", "off", "late")
    for i in range(args.rounds):
        for kind in order[i % 3 :] + order[: i % 3]:  # each kind first in turn
            report = sample(modules, kind)[0]
            if kind == "late":
                late_imports.append(report["imports"])
                late_apply.append(report["apply"])
            else:
                (on if kind == "on" else off).append(report["imports"])
    result = {
        "rounds": args.rounds,
        "target_modules": modules,
        **ratios(on, off, late_imports, late_apply),
        "goal_ratio_at_most": 0.02,
        "fix_states": states,
        "printed_by_probes": printed,
        "written_by_probes": written,
    }
    print(json.dumps(result, indent=2))
    return 0 if not printed and not written else 1


if __name__ == "__main__":
    sys.exit(main())
