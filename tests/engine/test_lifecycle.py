"""The lifecycle every fix inherits, run for every discovered fix (as ddtrace's PatchTestCase does for
every integration), each order in a fresh interpreter:

* Megatron first, a user module's ``from x import f`` bindings made before the fix: with the fix's
  flag ``off`` nothing in Megatron changes; switched on, every change is a marked replacement in
  place, ``original()`` reaches what it replaced, module-level replacements pickle by reference,
  the user's bindings are rebound; apply twice + ``importlib.reload`` leave one layer; ``revert()``
  restores the exact original objects, bindings included.
* The fix first (neither torch nor megatron imported by it), Megatron after: the post-import hooks
  apply it with the same outcome; a ``spawn`` child (as Megatron's async writer starts) gets the
  same state and the same changes.

What a fix changed is read from the engine's record of its changes (``ENGINE.changes``), never
from the fix's own code. On a release that does not need a fix, nothing may change at all.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TESTS, _child_env
from mcore_ckpt_fixes.engine.flags import env_var_for
from mcore_ckpt_fixes.engine.registry import ENGINE

FIX_IDS = [f.id for f in ENGINE.discover().values() if f.implemented]
CHILD = os.path.join(TESTS, "engine", "lifecycle_child.py")


def _child(mode, fix_id, env):
    full_env = _child_env([ROOT, TESTS, os.path.join(TESTS, "engine")], env)
    proc = subprocess.run(
        [sys.executable, CHILD, mode, fix_id], env=full_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.mark.parametrize("fix_id", FIX_IDS)
def test_lifecycle(fix_id):
    first = _child("megatron-first", fix_id, {"MCORE_CKPT_FIXES": fix_id, env_var_for(fix_id): "off"})
    late = _child("fix-first", fix_id, {"MCORE_CKPT_FIXES": fix_id})
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
