"""patches/<fix-id>/<release>.patch: applied with ``patch -p1`` to a pristine copy of this
environment's Megatron-Core (the unpacked wheel, site-packages layout), then

* every probe of the monkeypatch finds the bug fixed in the patched source (so a monkeypatch that
  learns a new target or probe, or a diff that loses a hunk, fails here: the two stay in step), and
* the fix's round trips, run with the monkeypatch off, are exact on every rank.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from mcore_ckpt_fixes.engine.registry import ENGINE

PATCHES = os.path.join(ROOT, "patches")


def _implemented_fixes_with_patches():
    return sorted(
        f.id for f in ENGINE.discover().values() if f.implemented and os.path.isdir(os.path.join(PATCHES, f.id))
    )


def _patch_for(fix_id, version):
    return os.path.join(PATCHES, fix_id, f"{version}.patch")


@pytest.fixture(scope="module")
def warm_python():
    """One interpreter with torch imported, forking a child per patched-source script."""
    from conftest import WarmPython

    warm = WarmPython()
    yield warm
    warm.close()


@pytest.fixture(scope="module")
def pristine_megatron():
    from mcore_ckpt_fixes.engine.version import detect

    info = detect()
    assert info.source == "wheel", info.describe()
    return info.path


def test_every_implemented_fix_ships_its_patches(mcore_version):
    """Each implemented fix has a diff for this release exactly when the release is affected."""
    for fix in ENGINE.discover().values():
        if not fix.implemented:
            continue
        expected = mcore_version in fix.specifiers
        assert os.path.exists(_patch_for(fix.id, mcore_version)) == expected, (fix.id, str(mcore_version))


SCRIPT = r"""
import json, os, sys, tempfile
import megatron
assert megatron.__path__[0] == os.environ["PATCHED_MEGATRON"], megatron.__path__
from mcore_ckpt_fixes.testing import all_scenarios, resolve
fix_id = os.environ["FIX_ID"]
mine = [s for s in all_scenarios() if s.fix_id == fix_id]
for prep in {s.prepare for s in mine if s.prepare}:
    resolve(prep)()
import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.registry import ENGINE
# Probes: forced on so the version range does not short-cut them; each must see the fix in place.
mcore_ckpt_fixes.revert(); mcore_ckpt_fixes.apply({"MCORE_CKPT_FIXES": fix_id, "MCORE_CKPT_FIX_" + fix_id.upper().replace("-", "_"): "on"})
import importlib
absent = []
for t in ENGINE.fixes[fix_id].targets:
    try:
        importlib.import_module(t.module)
    except ImportError:  # e.g. megatron.training, which wheels ship only from 0.17
        absent.append(t.module)
row = {r["id"]: r for r in mcore_ckpt_fixes.report()}[fix_id]
from mcore_ckpt_fixes.testing.launcher import run_world, values
out = {"probe": row["targets"], "absent": absent, "round_trips": {}}
for s in mine:
    if s.absent() is not None:
        continue  # the feature the scenario needs is not in this release
    d = tempfile.mkdtemp()
    res = values(run_world(s.func, s.nproc, {"ckpt_dir": d, "patched": False}, env={"MCORE_CKPT_FIXES": "off"}, timeout=240))
    out["round_trips"][s.name] = [{"error": r["error"], "max_delta": r["max_delta"], "n_tensors": r["n_tensors"]} for r in res]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("fix_id", _implemented_fixes_with_patches())
def test_patch_applies_and_round_trips_without_monkeypatch(
    fix_id, mcore_version, pristine_megatron, tmp_path, warm_python
):
    patch_file = _patch_for(fix_id, mcore_version)
    fix = ENGINE.discover()[fix_id]
    if mcore_version not in fix.specifiers:
        assert not os.path.exists(patch_file)  # nothing to patch on a release without the bug
        return
    shutil.copytree(pristine_megatron, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    for args in (["--dry-run"], []):
        proc = subprocess.run(
            ["patch", "-p1", "--forward", *args, "-i", patch_file], cwd=tmp_path, capture_output=True, text=True
        )
        assert proc.returncode == 0 and "FAILED" not in proc.stdout and "fuzz" not in proc.stdout.lower(), (
            proc.stdout + proc.stderr
        )
    assert not glob.glob(str(tmp_path / "megatron" / "**" / "*.rej"), recursive=True)

    # The patched Megatron-Core shadows the installed one.
    env = {"PYTHONPATH": str(tmp_path), "PATCHED_MEGATRON": str(tmp_path / "megatron"), "FIX_ID": fix_id}
    # A fresh interpreter's environment and path (the patched tree first), forked from one that has
    # imported torch only: Megatron-Core is imported from the patched tree in each child.
    proc = warm_python.run(SCRIPT, env, timeout=900, main_only=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    # Absent: megatron.training before 0.17, and frameworks' modules (Bridge, verl, ...), whose own
    # diffs are tested in their framework lines (tests/frameworks).
    frameworks = {t.module for t in fix.targets if not t.module.startswith(("megatron.core.", "megatron.training."))}
    assert set(result["absent"]) <= {"megatron.training.checkpointing"} | frameworks, result["absent"]
    for module, state in result["probe"].items():
        if module in result["absent"]:  # not in this release's wheel: its hook never fires
            # (a framework gated by its own version and not installed: reported not-applicable)
            assert state["state"] in (("pending", "not-applicable") if module in frameworks else ("pending",)), (
                module,
                state,
            )
            continue
        assert state["state"] == "not-needed" and state["reason"].startswith("probe:"), (module, state)
    assert set(result["probe"]) == {t.module for t in fix.targets}
    for name, ranks in result["round_trips"].items():
        for rank, r in enumerate(ranks):
            assert r["error"] is None, (name, rank, r["error"])
            assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (name, rank, r["max_delta"])


PATCHGEN = os.path.join(ROOT, "tools", "patchgen")


@pytest.mark.parametrize("fix_id", _implemented_fixes_with_patches())
def test_committed_patch_is_what_patchgen_writes_today(fix_id, mcore_version, pristine_megatron):
    """The diff is generated from the monkeypatch's own edits or code: regenerating it from this
    release's pristine source must give the committed file byte for byte (edit one, regenerate both)."""
    patch_file = _patch_for(fix_id, mcore_version)
    if not os.path.exists(patch_file):
        assert mcore_version not in ENGINE.discover()[fix_id].specifiers
        return
    src_root = os.path.dirname(pristine_megatron)
    cmd = [sys.executable, PATCHGEN, fix_id, src_root, str(mcore_version)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with open(patch_file, encoding="utf-8") as f:
        assert proc.stdout == f.read(), f"{patch_file} is stale: run {' '.join(cmd[1:])}"
