"""Every fix at once, on this line: each fix the engine reports ``applied`` has recorded its
changes, and ``revert()`` puts every recorded attribute back to the exact object it held. And several
fixes on one attribute: each a layer calling the one below, in the declared order whatever the order
they were applied in; ``revert()`` of one takes out exactly its layer; a marked replacement no layer
put there is refused at apply, with one line naming both fixes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, child_env

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code_or_file, env=None):
    cmd = [sys.executable, code_or_file] if code_or_file.endswith(".py") else [sys.executable, "-c", code_or_file]
    proc = subprocess.run(cmd, env=child_env([ROOT, HERE], env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_fix_at_once_records_its_changes_and_reverts_exactly():
    out = _run(os.path.join(HERE, "all_fixes_child.py"))
    applied = [f for f, s in out["states"].items() if s == "applied"]
    assert applied, out["states"]
    assert not [f for f, s in out["states"].items() if s == "failed"], out["states"]
    assert {f: n for f, n in out["changes"].items() if n == 0} == {}, out["changes"]  # applied = recorded
    assert sorted(out["changes"]) == sorted(applied)
    assert out["not_restored"] == [], out["not_restored"]


def test_fixes_on_one_attribute_layer_in_declared_order_and_revert_one_layer_each():
    out = _run(os.path.join(HERE, "layers_child.py"))
    assert out["states"] == ["applied", "applied"], out
    below_ours = ["high", "low"]  # each layer calls the one below it; the product fix's layer is under both
    changes = out["all"].pop("changes")  # the helper and each module that binds it by name
    assert changes[0] == changes[1] >= 2, out
    assert out["all"] == {"held": ["layer-high"] * 2, "calls": below_ours}, out
    assert out["high_reverted"] == {"held": ["layer-low"] * 2, "calls": ["low"]}, out
    assert out["high_again"] == {"held": ["layer-high"] * 2, "calls": below_ours}, out
    # The middle layer out: the top one now stands on what was under it.
    assert out["low_reverted"]["held"] == ["layer-high"] * 2 and out["low_reverted"]["calls"] == ["high"], out
    assert out["low_reverted"]["high_below_is_release"] is (not out["product_layers"]), out
    assert out["all_reverted"] == {"release_back": [True, True], "calls": []}, out
    assert out["out_of_order"] == {"held": ["layer-high"] * 2, "calls": below_ours}, out
    assert out["out_of_order_reverted"] is True, out
    conflict = out["conflict"]
    assert conflict["state"] == "failed" and conflict["kept"] is True, conflict
    assert (
        "megatron.core.utils.make_sharded_tensor_for_checkpoint holds foreign-copy's replacement, which no layer "
        "here put there; layer-low cannot layer on it" in conflict["reason"]
    ), conflict
