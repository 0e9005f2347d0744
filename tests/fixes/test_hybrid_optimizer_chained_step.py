"""hybrid-optimizer-chained-step: both halves on every affected CI line (see checks/core.py).

World 1 (gloo on CPU), a dense and an expert distributed optimizer over hybrid optimizers, chained
as Megatron chains them for a MoE model, every parameter offloaded or half; saved fully_sharded_model_space,
loaded into a fresh run, two steps against the uninterrupted run. One world per half, both cases in it.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.hybrid_optimizer_chained_step import FIX, MODULE
from mcore_ckpt_fixes.fixes.hybrid_optimizer_chained_step.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.hybrid_optimizer_chained_step.checks.core import CASES

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_chained_step.checks.core"
BUGS = {"full_offload": sc.LOAD_FAILS, "partial_offload": sc.NEXT_STEP_FAILS}
KINDS = {"model", "main", "exp_avg", "exp_avg_sq", "inner"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version, nproc=1)


@pytest.mark.parametrize("case", CASES)
def test_unpatched_the_chained_save_breaks_the_resume(worlds, case):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == (BUGS[case].phase, BUGS[case].error), (rank, r["phase"], r.get("traceback"))
    assert BUGS[case].seen_in(results)


@pytest.mark.parametrize("case", CASES)
def test_patched_two_resumed_steps_are_the_uninterrupted_runs(worlds, case):
    for rank, w in enumerate(worlds[True]):
        r = w[case]
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        kinds = {key.split("/")[1] for key in r["max_delta"]}
        assert KINDS <= kinds, (rank, kinds)
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: v for k, v in r["max_delta"].items() if v})
