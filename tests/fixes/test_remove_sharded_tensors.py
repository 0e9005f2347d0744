"""remove-sharded-tensors: both halves on every affected CI line (see checks/core.py).

World 1 (gloo on CPU): a torch_dist checkpoint saved with separation_hint="optimizer", whose
optimizer tensors ``dist_checkpointing.remove_sharded_tensors`` drops.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.remove_sharded_tensors import FIX, MODULE, SERIALIZATION
from mcore_ckpt_fixes.fixes.remove_sharded_tensors.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.remove_sharded_tensors.checks.core import MODEL

CORE = "mcore_ckpt_fixes.fixes.remove_sharded_tensors.checks.core"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(
        FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version, nproc=1
    )


def test_unpatched_the_removal_stops_with_attribute_error(worlds, mcore_version):
    bug = sc.SCENARIOS[0].bug_for(mcore_version)
    (r,) = worlds[False]
    assert set(r["fix_state"].values()) == {"disabled"}, r["fix_state"]
    assert (r["phase"], r["error"]) == (bug.phase, bug.error), (r["phase"], r.get("traceback"))
    assert any(f.startswith("optimizer") for f in r["files_before"]), r["files_before"]


def test_patched_the_optimizer_tensors_are_gone_and_the_model_loads_exactly(worlds, mcore_version):
    (r,) = worlds[True]
    assert r["fix_state"][MODULE] == "applied", r["fix_state"]
    # The public call needs the fix where it asks the save strategy (0.17-0.18).
    assert r["fix_state"][SERIALIZATION] == ("applied" if mcore_version.release[:2] >= (0, 17) else "not-needed")
    assert r["error"] is None, (r["phase"], r["error"], r.get("traceback"))
    removed = [f for f in r["files_before"] if f.startswith("optimizer")]
    assert removed and r["files_after"] == sorted(set(r["files_before"]) - set(removed)), (
        r["files_before"],
        r["files_after"],
    )
    assert r["keys_after"] == sorted(MODEL), r["keys_after"]
    assert set(r["max_delta"]) == set(MODEL) and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
