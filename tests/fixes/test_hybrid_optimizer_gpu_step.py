"""hybrid-optimizer-gpu-step: both halves on every affected CI line (see checks/core.py).

World 2 (gloo on CPU), the distributed optimizer with CPU offload of half the parameters (a GPU
FusedAdam stand-in for the other half), or of none (fraction 0: the FusedAdam steps them all), saved
and resumed, two steps against the uninterrupted run. One world per half, both cases in it.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.hybrid_optimizer_gpu_step import DIST_MODULE, FIX, MODULE
from mcore_ckpt_fixes.fixes.hybrid_optimizer_gpu_step.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_gpu_step.checks.core"
CASES = {"partial_offload": sc.FROZEN, "gpu_only": sc.LOST}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _scenario(name):
    return next(s for s in sc.SCENARIOS if s.name == name)


@pytest.mark.parametrize("case", CASES)
def test_unpatched_the_gpu_step_is_not_the_uninterrupted_runs(worlds, case, mcore_version):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled", DIST_MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("steps", CASES[case].error), (rank, r["phase"], r.get("traceback"))
    assert _scenario(case).bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", CASES)
def test_patched_two_resumed_steps_are_exact_on_every_rank(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied", DIST_MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["gpu_steps"] == r["reference_gpu_steps"] == [5, 5], (rank, r["gpu_steps"])
        kinds = {k.split("/")[1] for k in r["max_delta"]}
        assert {"next1", "next2"} == {k.split("/")[0] for k in r["max_delta"]} and {"model", "main"} <= kinds, kinds
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})
