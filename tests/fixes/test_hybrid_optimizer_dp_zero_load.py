"""hybrid-optimizer-dp-zero-load: both halves on every affected CI line (see checks/core.py).

World 2 (gloo on CPU), the distributed optimizer with CPU offload of every parameter or of half of
them, saved and loaded in the legacy torch format (dp_zero) in load_checkpoint's order; the state
right after the load and after two steps against the saved run. One world per half, both cases in it.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.hybrid_optimizer_dp_zero_load import DIST_MODULE, FIX, MODULE
from mcore_ckpt_fixes.fixes.hybrid_optimizer_dp_zero_load.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.hybrid_optimizer_dp_zero_load.checks.core import CASES

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_dp_zero_load.checks.core"
KINDS = {"model", "main", "exp_avg", "exp_avg_sq", "inner", "master_param"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _scenario(name):
    return next(s for s in sc.SCENARIOS if s.name == name)


@pytest.mark.parametrize("case", CASES)
def test_unpatched_the_resumed_model_is_not_the_saved_one(worlds, case, mcore_version):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled", DIST_MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("judge", sc.STALE.error), (rank, r["phase"], r.get("traceback"))
        # Right after the load: the model, its shards the optimizer holds and the copies it steps
        # are not the saved ones; the loaded moments are.
        assert {"model", "main", "inner"} <= set(r["loaded_differs"]), (rank, r["loaded_differs"])
        assert not {"exp_avg", "exp_avg_sq"} & set(r["loaded_differs"]), (rank, r["loaded_differs"])
    assert _scenario(case).bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", CASES)
def test_patched_the_resume_is_exact_on_every_rank(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied", DIST_MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["hybrid"] == ["HybridDeviceOptimizer"], (rank, r["hybrid"])
        assert {k.split("/")[0] for k in r["max_delta"]} == {"loaded", "next1", "next2"}, sorted(r["max_delta"])
        assert {k.split("/")[1] for k in r["max_delta"]} == KINDS, sorted(r["max_delta"])
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})
