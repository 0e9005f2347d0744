"""hybrid-optimizer-gpu-step: both halves on every affected CI line (see checks/core.py).

World 2 (gloo on CPU), the distributed optimizer with CPU offload of half the parameters (a GPU
FusedAdam stand-in for the other half), saved and resumed, two steps against the uninterrupted run.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.hybrid_optimizer_gpu_step import FIX, MODULE
from mcore_ckpt_fixes.fixes.hybrid_optimizer_gpu_step.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_gpu_step.checks.core"
KINDS = {"model", "main", "exp_avg", "exp_avg_sq", "inner", "master_param"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:partial_offload", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_the_gpu_step_stays_at_the_checkpoints(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("steps", sc.FROZEN.error), (rank, r["phase"], r.get("traceback"))
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_two_resumed_steps_are_exact_on_every_rank(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["gpu_steps"] == r["reference_gpu_steps"] == [5, 5], (rank, r["gpu_steps"])
        kinds = {k.split("/")[1] for k in r["max_delta"]}
        assert {"next1", "next2"} == {k.split("/")[0] for k in r["max_delta"]} and {"model", "main"} <= kinds, kinds
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})
