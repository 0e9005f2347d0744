"""persistent-worker-cpu-snapshot: both halves on every affected CI line.

World 2 (gloo on CPU): async torch_dist saves of CPU tensors through Megatron-Core's persistent
checkpoint worker; the trainer updates them in place right after the second save is scheduled. See
mcore_ckpt_fixes/fixes/persistent_worker_cpu_snapshot/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.persistent_worker_cpu_snapshot import FIX, MODULE
from mcore_ckpt_fixes.fixes.persistent_worker_cpu_snapshot.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.persistent_worker_cpu_snapshot.checks.core"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_the_checkpoint_holds_the_next_steps_values(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("compare", sc.LATER_VALUES.error), (rank, r["phase"], r.get("traceback"))
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_the_checkpoint_holds_the_values_at_the_save(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] == 4 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


def test_where_nothing_changes_the_tensors_both_halves_save_the_same_bits(worlds):
    for patched in (False, True):
        for rank, r in enumerate(worlds[patched]):
            got = {k: d for k, d in r["max_delta"].items() if k.startswith("unchanged/")}
            assert len(got) == 2 and set(got.values()) == {0.0}, (patched, rank, got)
    digests = [{k: d for k, d in r["digests"].items() if k.startswith("unchanged/")} for r in worlds[False]]
    assert digests == [{k: d for k, d in r["digests"].items() if k.startswith("unchanged/")} for r in worlds[True]]
