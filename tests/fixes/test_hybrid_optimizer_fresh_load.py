"""hybrid-optimizer-fresh-load: both halves on every affected CI line.

World 2 (gloo on CPU), ``optimizer_cpu_offload`` with the distributed optimizer: the model's weights
loaded without the optimizer's state, one step against a run whose optimizer was built over them.
Core API (one world per half, three cases) and megatron.training's fp32 job with --no-load-optim and
--finetune (0.17 on). See mcore_ckpt_fixes/fixes/hybrid_optimizer_fresh_load/checks/core.py.
"""

import pytest
from fix_worlds import both_halves
from packaging.version import Version

from mcore_ckpt_fixes.fixes.hybrid_optimizer_fresh_load import FIX, MODULE, TRAINING
from mcore_ckpt_fixes.fixes.hybrid_optimizer_fresh_load.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.hybrid_optimizer_fresh_load.checks.core import WAYS
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.hybrid_optimizer_fresh_load.checks.core"
BUGGY = ("bf16", "fp32")  # the cases the release leaves stale on every CI line
KINDS = {"model", "main", "exp_avg", "exp_avg_sq", "inner"}
MASTER = "master_param"  # the hybrid optimizer's state, where it keeps the copy it steps there


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


@pytest.fixture(scope="module")
def training(tmp_path_factory, mcore_version):
    if mcore_version < Version("0.17.0"):
        pytest.skip("megatron.training ships in the wheel from 0.17.0")
    return both_halves(FIX, f"{CORE}:training", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _scenario(name):
    return next(s for s in for_fix(FIX.id) if s.name == name)


@pytest.mark.parametrize("case", BUGGY)
def test_unpatched_steps_the_initial_weights_on_every_rank(worlds, case, mcore_version):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("compare", sc.STALE.error), (rank, r["phase"], r.get("traceback"))
        # What the optimizer steps is still the weights it was built over, not the loaded ones ...
        assert r["copies_vs_initial"] == 0.0 and r["copies_vs_loaded"] > 0.0, (rank, r)
        # ... and the step writes them back: the model differs from the reference's.
        assert any(d > 0.0 for k, d in r["max_delta"].items() if k.startswith("model/")), (rank, r["max_delta"])
    assert _scenario(case).bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", BUGGY + ("precision_aware",))
def test_patched_load_and_step_are_exact_on_every_rank(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["copies_vs_loaded"] == 0.0, (rank, r["copies_vs_loaded"])
        assert r["cpu_copies"] == sum(1 for k in r["max_delta"] if k.startswith("inner/")), (rank, r["cpu_copies"])
        assert KINDS <= {k.split("/")[0] for k in r["max_delta"]} <= KINDS | {MASTER}, sorted(r["max_delta"])
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})


def test_precision_aware_path_is_the_release_bit_for_bit(worlds, mcore_version):
    """Where the release refreshes the copies itself (0.13 on), the fix changes nothing: the same
    state after the step, bit for bit, with it off and on."""
    if mcore_version < Version("0.13.0"):
        pytest.skip("0.12 refreshes nothing with the precision-aware optimizer either")
    off, on = ([w["precision_aware"] for w in worlds[p]] for p in (False, True))
    for rank, (a, b) in enumerate(zip(off, on)):
        assert a["error"] is None and a["copies_vs_loaded"] == 0.0, (rank, a["error"], a.get("traceback"))
        assert set(a["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in a["max_delta"].items() if d})
        assert a["digests"] and a["digests"] == b["digests"], rank


def test_unpatched_training_fp32_load_steps_the_initial_weights(training, mcore_version):
    results = training[False]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {TRAINING: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("compare", sc.STALE.error), (rank, r["phase"], r.get("traceback"))
        for way in WAYS:
            assert r[f"{way}/copies_vs_initial"] == 0.0 and r[f"{way}/copies_vs_loaded"] > 0.0, (rank, way, r)
            assert any(d > 0.0 for k, d in r["max_delta"].items() if k.startswith(f"{way}/")), (rank, way)
    assert _scenario("training").bug_for(mcore_version).seen_in(results)


def test_patched_training_fp32_load_and_step_are_exact(training):
    for rank, r in enumerate(training[True]):
        assert r["fix_state"] == {TRAINING: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        for way in WAYS:
            assert r[f"{way}/copies_vs_loaded"] == 0.0, (rank, way)
            assert any(k.startswith(f"{way}/model/") for k in r["max_delta"]), (rank, way)
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})
