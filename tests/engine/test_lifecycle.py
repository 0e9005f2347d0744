"""The lifecycle every fix inherits, run for every discovered fix (as ddtrace's PatchTestCase does for
every integration), each order in one fresh interpreter for all the fixes:

* Megatron first, a user module's ``from x import f`` bindings made before the fix: with the fix's
  flag ``off`` nothing in Megatron changes; switched on, every change is a marked replacement in
  place, ``original()`` reaches what it replaced, module-level replacements pickle by reference,
  the user's bindings are rebound; apply twice + ``importlib.reload`` leave one layer; ``revert()``
  restores the exact original objects, bindings included.
* The fixes first (neither torch nor megatron imported by them), Megatron after: the post-import
  hooks apply every fix, as a user's default does, and each ends with the same outcome as alone; a
  ``spawn`` child (as Megatron's async writer starts) gets the same states and the same changes.

Megatron first checks one fix at a time, each reverted before the next (its revert is one of the
checks); each fix's result is its own test.

What a fix changed is read from the engine's record of its changes (``ENGINE.changes``), never
from the fix's own code. On a release that does not need a fix, nothing may change at all.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TESTS, child_env
from mcore_ckpt_fixes.engine.flags import env_var_for
from mcore_ckpt_fixes.engine.registry import ENGINE

FIX_IDS = [f.id for f in ENGINE.discover().values() if f.implemented]
CHILD = os.path.join(TESTS, "engine", "lifecycle_child.py")


def _child(mode, fix_ids, env):
    full_env = child_env([ROOT, TESTS, os.path.join(TESTS, "engine")], env)
    proc = subprocess.run(
        [sys.executable, CHILD, mode, ",".join(fix_ids)], env=full_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def lifecycles():
    """Both import orders, each in one fresh interpreter for every fix (a fresh interpreter per fix
    and order cost about a minute per fix and release line)."""
    every_fix_off = {env_var_for(fix_id): "off" for fix_id in FIX_IDS}
    first = _child("megatron-first", FIX_IDS, {"MCORE_CKPT_FIXES": ",".join(FIX_IDS), **every_fix_off})
    late = _child("fix-first", FIX_IDS, {"MCORE_CKPT_FIXES": ",".join(FIX_IDS)})
    return first, late


@pytest.mark.parametrize("fix_id", FIX_IDS)
def test_lifecycle(fix_id, lifecycles):
    first, late = lifecycles[0][fix_id], lifecycles[1][fix_id]
    assert "error" not in first, first.get("error")
    if not first["modules"]:  # none of its target modules exists in this release: the hooks wait
        assert (first["state"], first["changed"]) == ("pending", []), first
    else:
        assert first["state"] in ("applied", "not-needed", "not-applicable"), first
    if first["state"] != "applied":
        assert first["changed"] == [], first  # a release without the bug is left alone
    else:
        assert first["changed"], first
    # Either import order, and a spawn child, end the same way.
    for other in (late["parent"], late["spawn"]):
        assert (other["state"], other["modules"], other["changed"]) == (
            first["state"],
            first["modules"],
            first["changed"],
        ), (first, late)
