"""fused-adam-group-step: both halves on every affected CI line (checks/core.py).

0.12-0.13 (the 0.13.1 line) write the old checkpoint in the round trip's own world. From 0.14 on a
release writes every group's step, so the checkpoint that shows the bug comes from a 0.13.1 world
first (its environment: tools/envs.sh, built here if this line's run did not build it), written with
the fixes off (numpy2-product kept on: 0.13.1's save calls numpy's product, gone in numpy 2), as a
user's unfixed 0.13 job wrote it; both halves then load that one checkpoint.
"""

import os
import shutil
import subprocess

import pytest
from conftest import ROOT, child_env, envs_dir, run_py
from fix_worlds import both_halves
from packaging.version import Version

from mcore_ckpt_fixes.fixes.fused_adam_group_step import FIX
from mcore_ckpt_fixes.fixes.fused_adam_group_step.checks import core
from mcore_ckpt_fixes.fixes.fused_adam_group_step.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.fused_adam_group_step.checks.core"
OLD_RELEASE, OLD_PYTHON = "0.13.1", "py3.11"
WRITE = """
from mcore_ckpt_fixes.testing.launcher import run_world, values
from {core} import prepare
prepare()
kwargs = {{"ckpt_dir": {folder!r}}}
print(values(run_world("{core}:write_old_checkpoint", 2, kwargs, env={{"MCORE_CKPT_FIXES": "numpy2-product"}}, timeout=240)))
"""


def _old_checkpoint(folder):
    """The checkpoint (and the uninterrupted run's state) a 0.13.1 world writes into ``folder``."""
    envs = envs_dir()
    python = os.path.join(envs, OLD_PYTHON, "bin", "python")
    if not (os.path.isdir(os.path.join(envs, f"mcore-{OLD_RELEASE}")) and os.path.exists(python)):
        subprocess.run(["bash", os.path.join(ROOT, "tools", "envs.sh"), OLD_RELEASE], check=True, timeout=900)
    # 0.13.1's interpreter and path alone (not this line's), the fix flags of this environment left out.
    env = dict(child_env([], None), PYTHONPATH=os.pathsep.join([os.path.join(envs, f"mcore-{OLD_RELEASE}"), ROOT]))
    done = subprocess.run(
        [python, "-c", WRITE.format(core=CORE, folder=folder)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Each rank's non-empty groups' steps in the uninterrupted run: rank 0 holds one group.
    written = eval(done.stdout.strip().splitlines()[-1])
    assert written == [{"steps": [[AFTER]]}, {"steps": [[AFTER, AFTER]]}], written
    return folder


STEPS = core.STEPS
AFTER = core.STEPS + core.MORE


@pytest.fixture(scope="module")
def old(tmp_path_factory, mcore_version):
    """The old checkpoint's folder from 0.14 on; None before (the round trip writes its own)."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    return None if mcore_version < Version("0.14.0") else _old_checkpoint(str(tmp_path_factory.mktemp("old")))


@pytest.fixture(scope="module")
def worlds(old, tmp_path_factory, mcore_version):
    return both_halves(
        FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version, kwargs={"old": old}
    )


def test_unpatched_shows_the_documented_failure(worlds, mcore_version):
    results = worlds[False]
    # Rank 1 holds the group DP rank 0 saved without a step: it comes back without one.
    assert [r["loaded_steps"] for r in results] == [[[STEPS]], [[STEPS, None]]], results
    if mcore_version < Version("0.14.0"):
        # The release resumes it on step 1: after 3 steps it is on 3 where the uninterrupted run is on 8.
        assert results[1]["steps"] == [[AFTER, core.MORE]] and results[1]["reference_steps"] == [[AFTER, AFTER]]
        assert any(d != 0 for d in results[1]["max_delta"].values())
    else:
        # The next save stops on the rank holding it; every rank reports that rank's line.
        assert [r["rank_errors"] for r in results] == [[None, f"AssertionError: steps: [{AFTER}, {core.MORE}]"]] * 2
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(results)


def test_patched_round_trip_is_exact(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {core.MODULE: "applied"}, (rank, r["fix_state"])
        assert r["loaded_steps"] == [[STEPS] * (rank + 1)], (rank, r["loaded_steps"])
        assert r["steps"] == r["reference_steps"] == [[AFTER] * (rank + 1)], (rank, r["steps"])
        assert r["reloaded_steps"] == [[AFTER] * (rank + 1)], (rank, r["reloaded_steps"])
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


def test_the_fill_changes_only_groups_without_a_step():
    from mcore_ckpt_fixes.fixes.fused_adam_group_step.runtime.core import with_group_steps

    def sd(*steps):
        return {
            "optimizer": {
                "param_groups": [
                    {"wd_mult": i} if s is None else {"wd_mult": i, "step": s} for i, s in enumerate(steps)
                ]
            }
        }

    filled = with_group_steps(sd(5, None, 5))
    assert [g["step"] for g in filled["optimizer"]["param_groups"]] == [5, 5, 5]
    for unchanged in (sd(5, 5), sd(None, None), sd(5, 4, None), {"optimizer": {}}, {}):
        assert with_group_steps(unchanged) is unchanged  # the release's dict, as it was
    original = sd(5, None)
    with_group_steps(original)
    assert "step" not in original["optimizer"]["param_groups"][1]  # the loaded dict is not written


PATCHED_RUN = """
import megatron
assert megatron.__path__[0] == {megatron!r}, megatron.__path__  # the patched copy
from mcore_ckpt_fixes.testing.launcher import run_world, values
from {core} import prepare
prepare()
kwargs = {{"ckpt_dir": {ckpt!r}, "patched": False, "old": {old!r}}}
print(values(run_world("{core}:round_trip", 2, kwargs, env={{"MCORE_CKPT_FIXES": "off"}}, timeout=240)))
"""


def test_the_source_diff_resumes_an_old_checkpoint(old, mcore_version, tmp_path):
    """From 0.14 on (tests/patches runs the round trip where the release writes the old checkpoint
    itself): the release's source with this fix's diff, the monkeypatches off, resumes it exactly."""
    from mcore_ckpt_fixes.engine.version import detect

    if old is None:
        pytest.skip("before 0.14 tests/patches runs this round trip on the patched source")
    root = str(tmp_path / "patched")
    shutil.copytree(detect().path, os.path.join(root, "megatron"), ignore=shutil.ignore_patterns("__pycache__"))
    patch = os.path.join(ROOT, "patches", FIX.id, f"{mcore_version}.patch")
    applied = subprocess.run(["patch", "-p1", "--forward", "-i", patch], cwd=root, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    code = PATCHED_RUN.format(core=CORE, ckpt=str(tmp_path / "ckpt"), old=old, megatron=os.path.join(root, "megatron"))
    done = run_py(code, env={"PYTHONPATH": root})  # the patched copy first on the path
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = eval(done.stdout.strip().splitlines()[-1])
    for rank, r in enumerate(ranks):
        assert r["error"] is None and r["fix_state"] == {core.MODULE: "disabled"}, (rank, r["error"], r["fix_state"])
        assert r["steps"] == r["reference_steps"] == r["reloaded_steps"] == [[AFTER] * (rank + 1)], (rank, r)
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
