"""patches/<fix-id>/<release>.patch, as a user who vendors Megatron-Core applies them:

* each diff applies alone to a pristine copy of this environment's Megatron-Core (the unpacked
  wheel, site-packages layout): no hunk fails, none needs fuzz;
* every diff of this release applied one after another, in the order of their fix ids, to one
  copy: each applies there too (the diffs compose), and in one interpreter importing that tree,
  with the monkeypatch off,

  - every probe of every fix finds its bug fixed (a monkeypatch that learns a new target or probe,
    or a diff that loses a hunk, fails here: the two stay in step), and
  - every fix's round trips are exact on every rank.

One tree and one interpreter per line, not one per fix: importing Megatron-Core is most of such a
check's cost. In the shared tree one fix's diff could hide a hunk another committed diff lost (where
it happens to fix that bug too); the byte-for-byte regeneration below checks each committed diff on
its own against what patchgen writes from the monkeypatch.
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
from mcore_ckpt_fixes.testing import all_scenarios

PATCHES = os.path.join(ROOT, "patches")
ROUND_TRIP_TEST = "test_patched_source_round_trips_without_monkeypatch"


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


def _copy(megatron_dir, root):
    shutil.copytree(megatron_dir, os.path.join(root, "megatron"), ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _patch(root, patch_file, *args):
    return subprocess.run(
        ["patch", "-p1", "--forward", *args, "-i", patch_file], cwd=root, capture_output=True, text=True
    )


def test_every_implemented_fix_ships_its_patches(mcore_version):
    """Each implemented fix has a diff for this release exactly when the release is affected."""
    for fix in ENGINE.discover().values():
        if not fix.implemented:
            continue
        expected = mcore_version in fix.specifiers
        assert os.path.exists(_patch_for(fix.id, mcore_version)) == expected, (fix.id, str(mcore_version))


@pytest.fixture(scope="module")
def patched_here(request, mcore_version):
    """The fixes whose diffs this run applies: those this release has a diff for, among the ones
    the session selected (``-k`` narrows the shared tree and its interpreter too)."""
    selected = {
        item.callspec.params["fix_id"]
        for item in request.session.items
        if getattr(item, "originalname", None) == ROUND_TRIP_TEST
    }
    return [f for f in sorted(selected) if os.path.exists(_patch_for(f, mcore_version))]


@pytest.fixture(scope="module")
def pristine_copy(pristine_megatron, tmp_path_factory):
    """A copy of the wheel's source that each diff is tried on alone (``--dry-run``: it stays pristine)."""
    return _copy(pristine_megatron, str(tmp_path_factory.mktemp("pristine")))


@pytest.fixture(scope="module")
def patched_tree(pristine_megatron, patched_here, mcore_version, tmp_path_factory):
    """One copy with every diff of ``patched_here`` applied in turn: ``(root, {fix: patch's run})``;
    also those of the fixes their scenarios run alongside (with the monkeypatches off, their round
    trips need those diffs too)."""
    root = _copy(pristine_megatron, str(tmp_path_factory.mktemp("patched")))
    alongside = {other for s in all_scenarios() if s.fix_id in patched_here for other in s.alongside}
    needed = sorted(set(patched_here) | {f for f in alongside if os.path.exists(_patch_for(f, mcore_version))})
    return root, {fix_id: _patch(root, _patch_for(fix_id, mcore_version)) for fix_id in needed}


SCRIPT = r"""
import json, os, sys, tempfile, importlib
import megatron
assert megatron.__path__[0] == os.environ["PATCHED_MEGATRON"], megatron.__path__
from mcore_ckpt_fixes.testing import all_scenarios, resolve
# Before any prepare imports Megatron's modules, as the test session does (conftest): tp-group's
# scenarios need the stand-in in place when megatron.core.ssm.mamba_mixer is first imported.
from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in
install_mamba_ssm_stand_in()
fix_ids = os.environ["FIX_IDS"].split(",")
mine = [s for s in all_scenarios() if s.fix_id in fix_ids]
for prep in sorted({s.prepare for s in mine if s.prepare}):
    resolve(prep)()
import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.flags import env_var_for
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.testing.launcher import run_world, values
out = {}
for fix_id in fix_ids:
    # Probes: this fix alone, forced on so that the version range does not short-cut them; each
    # must see the fix in place.
    mcore_ckpt_fixes.revert()
    mcore_ckpt_fixes.apply({"MCORE_CKPT_FIXES": fix_id, env_var_for(fix_id): "on"})
    absent = []
    for t in ENGINE.fixes[fix_id].targets:
        try:
            importlib.import_module(t.module)
        except ImportError:  # e.g. megatron.training, which wheels ship only from 0.17
            absent.append(t.module)
    row = {r["id"]: r for r in mcore_ckpt_fixes.report()}[fix_id]
    out[fix_id] = {"probe": row["targets"], "absent": absent, "round_trips": {}}
mcore_ckpt_fixes.revert()
# One world per fix's batch (its scenarios that name the same batch, as its own tests run them; the
# world as large as its largest), one per scenario without one: the release's runnable scenarios.
worlds = {}
for s in mine:
    if s.absent() is None:  # else the feature the scenario needs is not in this release
        worlds.setdefault((s.fix_id, s.batch) if s.batch else (s.fix_id, s.func, s.name), []).append(s)
for together in worlds.values():
    first = together[0]
    kwargs = {"ckpt_dir": tempfile.mkdtemp(), "patched": False}
    if first.batch:
        kwargs["names"] = [s.name for s in together]
    try:
        ranks = values(run_world(first.batch or first.func, max(s.nproc for s in together), kwargs,
                                 env={"MCORE_CKPT_FIXES": "off"}, timeout=240 * len(together)))
        per_scenario = {s.name: [r[s.name] for r in ranks] if first.batch else ranks for s in together}
    except AssertionError as exc:  # a world that failed: this fix's test says so, the others go on
        failed = [{"error": str(exc)[-3000:], "max_delta": {}, "n_tensors": 0}]
        per_scenario = {s.name: failed for s in together}
    for name, res in per_scenario.items():
        out[first.fix_id]["round_trips"][name] = [
            {"error": r["error"], "max_delta": r["max_delta"], "n_tensors": r["n_tensors"]} for r in res
        ]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def patched_run(patched_tree, patched_here, warm_python):
    """What SCRIPT found in the shared tree, per fix; the script's output where it failed."""
    root, _ = patched_tree
    if not patched_here:  # no diff of this release was selected: no interpreter to start
        return {}
    env = {"PYTHONPATH": root, "PATCHED_MEGATRON": os.path.join(root, "megatron"), "FIX_IDS": ",".join(patched_here)}
    # A fresh interpreter's environment and path (the patched tree first), forked from one that has
    # imported torch only: Megatron-Core is imported from the patched tree in that child.
    proc = warm_python.run(SCRIPT, env, timeout=1800, main_only=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[0][7:])


@pytest.mark.parametrize("fix_id", _implemented_fixes_with_patches())
def test_patched_source_round_trips_without_monkeypatch(
    fix_id, mcore_version, pristine_copy, patched_tree, patched_run
):
    patch_file = _patch_for(fix_id, mcore_version)
    fix = ENGINE.discover()[fix_id]
    if mcore_version not in fix.specifiers:
        assert not os.path.exists(patch_file)  # nothing to patch on a release without the bug
        return
    alone = _patch(pristine_copy, patch_file, "--dry-run")
    assert alone.returncode == 0 and "FAILED" not in alone.stdout and "fuzz" not in alone.stdout.lower(), (
        alone.stdout + alone.stderr
    )
    root, applied = patched_tree
    together = applied[fix_id]
    assert together.returncode == 0 and "FAILED" not in together.stdout, together.stdout + together.stderr
    assert not glob.glob(os.path.join(root, "megatron", "**", "*.rej"), recursive=True)

    assert isinstance(patched_run, dict), patched_run  # else: the shared interpreter's output
    result = patched_run[fix_id]
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
