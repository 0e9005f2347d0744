"""A tree whose internals moved: this line's own Megatron-Core copied as a source checkout, with the
helper one fix's probe calls first renamed away and then given another signature. The probe that
cannot judge the code leaves it alone and says why: the fix is ``not-applicable`` with the reason,
never ``failed``, no other fix changes its state, and a ``require`` d fix refuses to start. Also
the engine's own rule, with a probe that raises on code it does not know.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import run_cli

FIX_ID = "rerun-state-strict-load"
VALIDATION = os.path.join("megatron", "core", "dist_checkpointing", "validation.py")
HELPER = "def _determine_missing_and_unexpected_keys("


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    import megatron

    src = os.path.dirname(megatron.__path__[0])
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(os.path.join(src, "megatron"), root / "megatron")
    return root


def _status(root, env=None):
    proc = run_cli(["status", "--json"], env={"PYTHONPATH": str(root), **(env or {})})
    return proc, ({r["id"]: r for r in json.loads(proc.stdout)} if proc.returncode == 0 else None)


def _edit(root, old, new):
    path = root / VALIDATION
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


@pytest.mark.one_line
def test_a_probe_that_cannot_judge_the_code_leaves_it_alone(tree):
    proc, before = _status(tree)
    assert proc.returncode == 0, proc.stderr
    assert before[FIX_ID]["state"] == "applied", before[FIX_ID]  # this line's code, as a checkout
    # Upstream reworks the helper: another parameter the probe does not pass.
    _edit(tree, HELPER + "\n", HELPER + "\n    strict,\n")
    proc, moved = _status(tree)
    assert proc.returncode == 0, proc.stderr
    row = moved[FIX_ID]
    assert row["state"] == "not-applicable", row
    assert "_determine_missing_and_unexpected_keys could not be judged (" in row["reason"], row["reason"]
    assert not [r for r in moved.values() if r["state"] == "failed"], moved
    assert {k: r["state"] for k, r in moved.items() if k != FIX_ID} == {
        k: r["state"] for k, r in before.items() if k != FIX_ID
    }
    proc = run_cli(["status"], env={"PYTHONPATH": str(tree), "MCORE_CKPT_FIX_RERUN_STATE_STRICT_LOAD": "require"})
    assert proc.returncode != 0 and "FixRequiredError" in proc.stderr, proc.stdout + proc.stderr
    # Then renamed away: the feature is absent.
    _edit(tree, HELPER + "\n    strict,\n", "def _find_mismatched_keys(\n")
    proc, renamed = _status(tree)
    assert renamed[FIX_ID]["state"] == "not-applicable", renamed[FIX_ID]
    assert renamed[FIX_ID]["reason"].endswith("has no _determine_missing_and_unexpected_keys"), renamed[FIX_ID]


@pytest.mark.one_line
def test_engine_leaves_code_alone_when_a_probe_raises():
    """A probe that raises on what it finds: the target is left alone (not-applicable, the reason
    names the error), no warning, no patch; under ``require`` the import refuses."""
    code = (
        "import warnings, megatron.core.utils\n"
        "from mcore_ckpt_fixes.engine.fix import Fix, Target\n"
        "from mcore_ckpt_fixes.engine.registry import ENGINE\n"
        "def probe(module): raise AttributeError('moved_helper')\n"
        "def apply(module, patcher): raise AssertionError('never applied')\n"
        "ENGINE.register(Fix(id='raising-probe', summary='test', affected='>=0', "
        "targets=(Target('megatron.core.utils', probe, apply),)))\n"
        "import mcore_ckpt_fixes\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    mcore_ckpt_fixes.apply()\n"
        "row = next(r for r in mcore_ckpt_fixes.report() if r['id'] == 'raising-probe')\n"
        "print(row['state'], '|', row['reason'], '|', len([w for w in caught if 'raising-probe' in str(w.message)]))\n"
    )
    import subprocess
    import sys

    from conftest import child_env

    env = child_env([os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))], None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    state, reason, warned = (part.strip() for part in out.stdout.strip().splitlines()[-1].split("|"))
    assert state == "not-applicable", out.stdout
    assert reason.endswith("left alone: the probe could not judge this code (AttributeError: moved_helper)"), reason
    assert warned == "0", out.stdout
