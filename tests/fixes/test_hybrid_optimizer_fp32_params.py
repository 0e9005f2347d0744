"""hybrid-optimizer-fp32-params: both halves on every release line, in one warm world per half.

World 2 (gloo on CPU): a one-layer GPT under Megatron's DDP whose optimizer is Megatron's
``HybridDeviceOptimizer`` with every parameter's state offloaded to the CPU (``optimizer_cpu_offload``,
Megatron-LM's default offload fraction 1.0), saved as Megatron-LM's ``torch`` format saves an
optimizer (its ``state_dict()``) and loaded into a fresh run after one step of its own: an fp32 model
through ``get_megatron_optimizer``, a bf16 model with fp32 norms and an all-bf16 model with the hybrid
optimizer built directly. See mcore_ckpt_fixes/fixes/hybrid_optimizer_fp32_params/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.hybrid_optimizer_fp32_params import FIX, MODULE
from mcore_ckpt_fixes.fixes.hybrid_optimizer_fp32_params.checks.core import CASES
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_fp32_params.checks.core"
# The cases whose models have fp32 parameters (the fix-off half stops on the first one).
WITH_FP32 = ("fp32", "mixed")
STATE_KINDS = {"model", "inner", "master_param", "exp_avg", "exp_avg_sq", "step"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    off = {"MCORE_CKPT_FIX_HYBRID_OPTIMIZER_FP32_PARAMS": "off"}
    return both_halves(FIX, f"{CORE}:cases", off, tmp_path_factory, mcore_version)


def _exact(r, rank):
    assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
    deltas = r["max_delta"]
    kinds = {k.split("/")[0] for k in deltas if not k.startswith("next/")}
    assert kinds == STATE_KINDS, (rank, sorted(kinds))
    assert {k for k in deltas if k.startswith("next/")} == {f"next/{k}" for k in deltas if not k.startswith("next/")}
    assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})


@pytest.mark.parametrize("case", WITH_FP32)
def test_unpatched_load_raises_key_error_for_an_fp32_parameter(worlds, case, mcore_version):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert r["fp32_params"], (rank, "the model has no fp32 parameter")
        assert (r["phase"], r["error"]) == ("load", "KeyError: a torch.float32 tensor"), (rank, r.get("traceback"))
        assert "_update_fp32_params_by_new_state" in r["traceback"], r["traceback"]
    if case == "fp32":  # selftest's judgement agrees
        assert for_fix(FIX.id)[0].bug_for(mcore_version).seen_in(results)


def test_unpatched_all_bf16_model_loads_exactly(worlds):
    """Where every parameter has an fp32 copy the release loads, exactly: the fix keeps that path."""
    for rank, r in enumerate(w["bf16"] for w in worlds[False]):
        assert r["fp32_params"] == [], (rank, r["fp32_params"])
        _exact(r, rank)


@pytest.mark.parametrize("case", CASES)
def test_patched_round_trip_and_next_step_are_exact(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert bool(r["fp32_params"]) is (case in WITH_FP32), (rank, r["fp32_params"])
        _exact(r, rank)
