"""hybrid-optimizer-common-state: both halves on every release line, in one warm world per half.

World 2 (DP=2, gloo on CPU): a one-layer bf16 GPT under Megatron's DDP and the distributed optimizer
with CPU offload (``HybridDeviceOptimizer``, as Megatron-LM builds it with ``--optimizer-cpu-offload``),
saved with ``dist_checkpointing`` as ``fully_reshardable`` and loaded into a fresh run; and the common
state such a save writes on 0.15-0.18 (``common.pt``), read back by the release. See
mcore_ckpt_fixes/fixes/hybrid_optimizer_common_state/checks/core.py.
"""

import pytest
from fix_worlds import both_halves
from packaging.version import Version

from mcore_ckpt_fixes.fixes.hybrid_optimizer_common_state import FIX, MODULE
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_common_state.checks.core"
REFUSED = ("load", "UnpicklingError: weights_only refuses torch.optim.adamw.AdamW")
STATE_KINDS = {"model", "main", "master_param", "exp_avg", "exp_avg_sq", "inner"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    off = {"MCORE_CKPT_FIX_HYBRID_OPTIMIZER_COMMON_STATE": "off"}
    return both_halves(FIX, f"{CORE}:cases", off, tmp_path_factory, mcore_version)


def test_unpatched_legacy_common_state_is_refused(worlds, mcore_version):
    results = [w["legacy_common_state"] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert r["classes"] == ["AdamW", "FusedAdam"], (rank, r["classes"])  # what the groups hold
        assert (r["phase"], r["error"]) == REFUSED, (rank, r.get("traceback"))
    assert for_fix(FIX.id)[0].bug_for(mcore_version).seen_in(results)  # selftest's judgement agrees


def test_unpatched_round_trip(worlds, mcore_version):
    """0.14-0.18 keep the param groups in common.pt: the load stops; 0.19 keeps its own common
    state in DCP and loads it."""
    for rank, r in enumerate(w["round_trip"] for w in worlds[False]):
        if mcore_version < Version("0.19.0"):
            assert (r["phase"], r["error"]) == REFUSED, (rank, r.get("traceback"))
        else:
            _exact(r, rank)


def _exact(r, rank):
    assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
    assert r["steps"] == [2.0], (rank, r["steps"])
    deltas = r["max_delta"]
    kinds = {k.split("/")[0] for k in deltas if not k.startswith("next/")}
    assert kinds == STATE_KINDS, (rank, sorted(kinds))
    assert {k for k in deltas if k.startswith("next/")} == {f"next/{k}" for k in deltas if not k.startswith("next/")}
    assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})


def test_patched_round_trip_and_next_step_are_exact(worlds):
    for rank, r in enumerate(w["round_trip"] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        _exact(r, rank)


def test_patched_legacy_common_state_reads_back(worlds):
    for rank, r in enumerate(w["legacy_common_state"] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


def test_only_the_optimizer_classes_are_allowed(tmp_path):
    """The fix widens torch's allow-list by the optimizer classes only: any other class is refused."""
    import pickle

    import torch

    from mcore_ckpt_fixes.fixes.hybrid_optimizer_common_state.runtime import core

    path = tmp_path / "common.pt"
    torch.save({"groups": [{"cls": torch.optim.AdamW}]}, path)
    assert core._allowing_optimizer_classes(torch.load, path)["groups"][0]["cls"] is torch.optim.AdamW
    torch.save({"hook": torch.nn.Linear}, path)
    with pytest.raises(pickle.UnpicklingError):
        core._allowing_optimizer_classes(torch.load, path)
