"""hybrid-optimizer-fp32-shards: both halves on every release line, in one warm world per half.

World 2 (gloo on CPU): a one-layer GPT under Megatron's DDP, ``get_megatron_optimizer`` with the
distributed optimizer, ``optimizer_cpu_offload`` (offload fraction 1.0) and the precision-aware
optimizer: an fp32 model (built, trained against the update computed apart, saved with
``dist_checkpointing`` as ``dp_reshardable`` and ``fully_reshardable`` and loaded into a fresh run)
and a bf16 model with fp32 norms (built and trained). See
mcore_ckpt_fixes/fixes/hybrid_optimizer_fp32_shards/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.hybrid_optimizer_fp32_shards import FIX, MODULE
from mcore_ckpt_fixes.fixes.hybrid_optimizer_fp32_shards.checks.core import CASES, FORMATS
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_fp32_shards.checks.core"
STATE_KINDS = {"model", "inner", "master_param", "exp_avg", "exp_avg_sq", "step"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    off = {"MCORE_CKPT_FIX_HYBRID_OPTIMIZER_FP32_SHARDS": "off"}
    return both_halves(FIX, f"{CORE}:cases", off, tmp_path_factory, mcore_version)


@pytest.mark.parametrize("case", CASES)
def test_unpatched_build_raises_non_leaf(worlds, case, mcore_version):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("build", "ValueError: can't optimize a non-leaf Tensor"), (
            rank,
            r.get("traceback"),
        )
        assert "HybridDeviceOptimizer(" in r["traceback"] and "distrib_optimizer.py" in r["traceback"], r["traceback"]
    if case == "fp32":  # selftest's judgement agrees
        assert for_fix(FIX.id)[0].bug_for(mcore_version).seen_in(results)


def _patched(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        yield rank, r


@pytest.mark.parametrize("case", CASES)
def test_patched_fp32_shards_are_leaf_views_of_the_parameters(worlds, case):
    for rank, r in _patched(worlds, case):
        assert r["fp32_shards"], (rank, "this rank's optimizer has no fp32 shard")
        assert set(r["fp32_shards"].values()) == {(True, True)}, (rank, r["fp32_shards"])


@pytest.mark.parametrize("case", CASES)
def test_patched_training_equals_the_update_computed_apart(worlds, case):
    """The gradient reached every shard and the update reached the model, exactly."""
    for rank, r in _patched(worlds, case):
        train = {k: d for k, d in r["max_delta"].items() if k.startswith("train/")}
        assert {k.split("/")[1] for k in train} == {"inner", "model"}, (rank, sorted(train))
        assert set(train.values()) == {0.0}, (rank, {k: d for k, d in train.items() if d})


def _saved(worlds, mcore_version):
    """The fp32 case's ranks; its round trips run from 0.16 on (every CI line), see checks/core.py."""
    from packaging.version import Version

    for rank, r in _patched(worlds, "fp32"):
        if mcore_version < Version("0.16.0") and not r["formats"]:
            pytest.skip("dp_reshardable saves torch AdamW's per-parameter step from 0.16 on")
        assert r["formats"] == list(FORMATS), (rank, r["formats"])
        yield rank, r


def _round_trip(r, fmt):
    deltas = {k[len(fmt) + 1 :]: d for k, d in r["max_delta"].items() if k.startswith(f"{fmt}/")}
    loaded = {k: d for k, d in deltas.items() if not k.startswith("next/")}
    assert {k.split("/")[0] for k in loaded} == STATE_KINDS, sorted(loaded)
    assert {k for k in deltas if k.startswith("next/")} == {f"next/{k}" for k in loaded}
    return deltas, loaded


def test_patched_fully_reshardable_round_trip_and_next_step_are_exact(worlds, mcore_version):
    for rank, r in _saved(worlds, mcore_version):
        deltas, _ = _round_trip(r, "fully_reshardable")
        assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})


def test_patched_dp_reshardable_round_trip_and_next_step_are_exact(worlds, mcore_version):
    """Exact with the fixes at their defaults: the step each parameter gets back from a dp_reshardable
    load is torch-adam-step's to keep (hybrid-device-optimizer-stale-step), applied here."""
    for rank, r in _saved(worlds, mcore_version):
        assert r["step_fix"] == "applied", (rank, r["step_fix"])
        deltas, _ = _round_trip(r, "dp_reshardable")
        assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})
