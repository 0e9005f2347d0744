"""Every fix at once, on this line: each fix the engine reports ``applied`` has recorded its
changes, and ``revert()`` puts every recorded attribute back to the exact object it held. And two
fixes on one attribute: the second is refused at apply, with one line naming both (replacements do
not stack), never reported ``applied`` over the first one's layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, _child_env

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code_or_file, env=None):
    cmd = [sys.executable, code_or_file] if code_or_file.endswith(".py") else [sys.executable, "-c", code_or_file]
    proc = subprocess.run(cmd, env=_child_env([ROOT, HERE], env), capture_output=True, text=True, timeout=300)
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


def test_a_second_fix_on_one_attribute_is_refused_naming_both():
    code = (
        "import json, megatron.core.utils\n"
        "import probe_fix\n"
        "from mcore_ckpt_fixes.engine.fix import Fix, Target\n"
        "from mcore_ckpt_fixes.engine.patching import mark\n"
        "from mcore_ckpt_fixes.engine.registry import ENGINE\n"
        "@mark('second-wrapper')\n"
        "def second(*a, **k): raise AssertionError('never called')\n"
        "def apply(module, patcher): patcher.replace_function(module, probe_fix.NAME, second)\n"
        "probe_fix.register()\n"
        "ENGINE.register(Fix(id='second-wrapper', summary='test', affected='>=0', "
        "targets=(Target(probe_fix.TARGET, probe_fix.probe, apply),)))\n"
        "import mcore_ckpt_fixes\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "mcore_ckpt_fixes.apply()\n"
        "rows = {r['id']: r for r in mcore_ckpt_fixes.report()}\n"
        "held = getattr(megatron.core.utils, probe_fix.NAME).__mcore_ckpt_fix__\n"
        "print(json.dumps({'first': rows['engine-probe']['state'], 'second': rows['second-wrapper']['state'], "
        "'reason': rows['second-wrapper']['reason'], 'held': held, "
        "'second_changes': len(ENGINE.changes('second-wrapper'))}))\n"
    )
    # dtensor-placement wraps the same helper: off, so that the two test fixes meet there.
    out = _run(code, {"MCORE_CKPT_FIX_DTENSOR_PLACEMENT": "off"})
    assert (out["first"], out["second"], out["held"], out["second_changes"]) == (
        "applied",
        "failed",
        "engine-probe",
        0,
    ), out
    assert "already holds engine-probe's replacement; second-wrapper cannot replace it too" in out["reason"], out
