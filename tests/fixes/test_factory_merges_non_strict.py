"""factory-merges-non-strict: both halves on every affected CI line, one warm world each.

World 2 (gloo on CPU, TP=2): a one-layer SwiGLU GPT (local spec) saved with dist_checkpointing and
loaded into the same model with a multi-token-prediction layer added, under assume_ok_unexpected,
log_all, ignore_all and return_all. The fix-off half turns off this fix alone. See
mcore_ckpt_fixes/fixes/factory_merges_non_strict/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.factory_merges_non_strict import FIX
from mcore_ckpt_fixes.fixes.factory_merges_non_strict.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.factory_merges_non_strict.checks.core import MERGE_ERROR, WAYS

CORE = "mcore_ckpt_fixes.fixes.factory_merges_non_strict.checks.core"
MODULE = "megatron.core.dist_checkpointing.serialization"
DEFAULT, *TOLERANT = WAYS


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_every_tolerant_strictness_stops_in_apply_factory_merges(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == ("load", sc.STOPPED), (rank, r["error"], r.get("traceback"))
        for way in TOLERANT:
            assert r["outcomes"][way].startswith(MERGE_ERROR), (rank, way, r["outcomes"][way])
            # The MTP layer's SwiGLU factory is what the merge finds without a loaded tensor.
            assert "mtp.layers.0." in r["outcomes"][way] and "linear_fc1" in r["outcomes"][way]
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_tolerant_strictness_loads_every_saved_tensor_and_leaves_the_new_layer_out(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        for way in TOLERANT:
            assert r["outcomes"][way] == "ok", (rank, way, r["outcomes"])
            compared = [k for k in r["max_delta"] if k.startswith(f"{way}/")]
            assert any(k.endswith("mlp.linear_fc1.weight") for k in compared), compared
            assert {r["max_delta"][k] for k in compared} == {0.0}, r["max_delta"]
            absent = r["absent"][way]
            assert absent and all(k.startswith("mtp.layers.0.") for k in absent), absent
            assert any(k.endswith("mlp.linear_fc1.weight") for k in absent), absent


def test_the_default_strictness_refuses_as_the_release_does(worlds):
    """assume_ok_unexpected reads no checkpoint key the request lacks: both halves stop in the read."""
    for off, on in zip(worlds[False], worlds[True]):
        assert off["outcomes"][DEFAULT] == on["outcomes"][DEFAULT], (off["outcomes"], on["outcomes"])
        assert on["outcomes"][DEFAULT].startswith("CheckpointException"), on["outcomes"]


# -- the helper on plain dicts (no world) -----------------------------------------------------------


@pytest.fixture
def helper():
    pytest.importorskip("megatron.core.dist_checkpointing.serialization")
    from mcore_ckpt_fixes.fixes.factory_merges_non_strict.runtime import core

    return core._factories_loaded


@pytest.mark.one_line  # the helper on plain dicts, the same on every line
def test_factories_of_loaded_entries_are_the_same_objects(helper):
    factories = {"a": {"w": 1}, "b": [2]}
    assert helper({"a": {"w": "t"}, "b": ["t"], "c": 0}, factories) is factories


@pytest.mark.one_line  # the helper on plain dicts, the same on every line
def test_factories_of_absent_entries_are_left_out_at_any_depth(helper):
    factories = {"a": {"w": 1, "v": 2}, "gone": {"x": 3}, "b": [4]}
    kept = helper({"a": {"w": "t"}, "b": ["t"]}, factories)
    assert kept == {"a": {"w": 1}, "b": [4]} and kept["b"] is factories["b"]
