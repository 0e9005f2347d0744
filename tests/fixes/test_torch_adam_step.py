"""torch-adam-step: both halves on every release line, in one warm world per half.

World 2 (DP=2, gloo on CPU), a one-layer GPT in bf16, Megatron's DDP and distributed optimizer on
torch's Adam (no Transformer Engine or Apex here, so Megatron takes its fallback), saved and loaded
with ``dist_checkpointing`` as ``dp_reshardable`` and ``fully_reshardable``; the target optimizer
fresh or after one step. The same with CPU offload (``HybridDeviceOptimizer``, whose CPU optimizers
are torch's AdamW), on the path Megatron takes with a FusedAdam installed and on the fallback. See
mcore_ckpt_fixes/fixes/torch_adam_step/checks/core.py.
"""

import pytest
from fix_worlds import both_halves
from packaging.version import Version

from mcore_ckpt_fixes.fixes.torch_adam_step import FIX
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.torch_adam_step.checks.core"
MODULE = "megatron.core.optimizer.distrib_optimizer"
SCENARIOS = {s.name: s for s in for_fix(FIX.id)}
# What the fix-off half shows per case on a release that needs the fix (every CI line).
STALE = ("step", "AssertionError: per-parameter step after the load: [1.0], the checkpoint's: 3.0")
UNPATCHED = {
    "fresh_load": ("load_request", "AssertionError: "),
    "stale_step": STALE,
    "fully_reshardable": ("load", "KeyError: 'step'"),
    "fresh_fully_reshardable": ("load_request", "AssertionError: "),
    # CPU offload: a fresh hybrid optimizer takes a step of its own inside load_state_dict (dummy_step).
    "hybrid_stale_step": STALE,
    "hybrid_fresh_load": STALE,
    "hybrid_torch_stale_step": STALE,
}
# Before 0.19 the common state of a fully_reshardable save (common.pt, read with torch.load's
# weights_only default since torch 2.6) holds the hybrid optimizer's class objects from its param
# groups: with every fix off the load stops (hybrid-optimizer-common-state's bug, on in the other half).
WEIGHTS_ONLY = "UnpicklingError: Weights only load failed."


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    """Both halves, every case, one world each (the cases share one save per sharding type)."""
    return both_halves(FIX, f"{CORE}:cases", {"MCORE_CKPT_FIXES": "off"}, tmp_path_factory, mcore_version)


@pytest.mark.parametrize("case", list(UNPATCHED))
def test_unpatched_shows_the_documented_failure(worlds, case, mcore_version):
    results = [r[case] for r in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == UNPATCHED[case], (rank, r.get("traceback"))
        if r["error"] == "AssertionError: ":  # the release's bare assert: which one, from the traceback
            assert "assert len(steps) == 1" in r["traceback"] and "in state_dict" in r["traceback"], r["traceback"]
    if case in SCENARIOS:  # selftest's judgement agrees
        assert SCENARIOS[case].bug_for(mcore_version).seen_in(results)


def _exact(r, rank, case):
    assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
    assert r["steps"] == [3.0], (rank, r["steps"])
    deltas = r["max_delta"]
    # main-parameter shards, exp_avg, exp_avg_sq and model parameters (with CPU offload also the
    # fp32 master and the copy each CPU optimizer updates), after the load and after one more step
    # (against the uninterrupted run)
    want = {"model", "main", "exp_avg", "exp_avg_sq"}
    if case.startswith("hybrid"):
        want |= {"master_param", "inner"}
    kinds = {k.split("/")[0] if not k.startswith("next/") else "next/" + k.split("/")[1] for k in deltas}
    assert kinds == want | {f"next/{k}" for k in want}, (rank, kinds)
    assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})


@pytest.mark.parametrize("case", list(UNPATCHED))
def test_patched_restores_every_step_and_the_next_step_matches(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        _exact(r, rank, case)


def test_hybrid_fully_reshardable_is_exact(worlds, mcore_version):
    """fully_reshardable hands the hybrid optimizer no step: the release restores it and the fixes
    keep that; with every fix off, before 0.19 the load stops earlier, on another bug."""
    for rank, r in enumerate(w["hybrid_fully_reshardable"] for w in worlds[True]):
        _exact(r, rank, "hybrid_fully_reshardable")
    for rank, r in enumerate(w["hybrid_fully_reshardable"] for w in worlds[False]):
        if mcore_version < Version("0.19.0"):
            assert r["phase"] == "load" and r["error"].startswith(WEIGHTS_ONLY), (rank, r["error"])
            assert "torch.optim.adamw.AdamW" in r["traceback"], r["traceback"]
        else:
            _exact(r, rank, "hybrid_fully_reshardable")


def test_probe_finds_the_three_defects(mcore_version):
    import megatron.core.optimizer.distrib_optimizer as m
    from mcore_ckpt_fixes.fixes.torch_adam_step.runtime import core

    flag = m.HAVE_APEX_OR_TE  # False on these CPU lines: neither TE nor Apex is installed
    verdict, why = core.probe(m)  # the release's own methods, even after apply
    assert m.HAVE_APEX_OR_TE is flag  # the probe puts the flag back
    assert verdict is True and why.startswith("DistributedOptimizer on torch's Adam: (a) "), why
    assert [d[:3] for d in core.defects(m)] == ["(a)", "(b)", "(c)", "(d)"], why
    if not flag:
        assert why.endswith("(this installation uses torch's Adam)"), why


def test_probe_leaves_the_live_flag_alone(monkeypatch):
    """On an installation with a FusedAdam (HAVE_APEX_OR_TE True) the probe still finds the torch-Adam
    defects, by running copies of the release's methods that see the torch path's flag; the module's
    own flag is never set to anything else, not even while the probe runs."""
    import megatron.core.optimizer.distrib_optimizer as m

    from mcore_ckpt_fixes.fixes.torch_adam_step.runtime import core

    monkeypatch.setattr(m, "HAVE_APEX_OR_TE", True)
    seen = []
    stand_in = core.optimizer_stand_in

    def watching(*args, **kwargs):  # called while the probe runs the release's methods
        seen.append(m.HAVE_APEX_OR_TE)
        return stand_in(*args, **kwargs)

    monkeypatch.setattr(core, "optimizer_stand_in", watching)
    assert [d[:3] for d in core.defects(m)] == ["(a)", "(b)", "(c)", "(d)"]
    assert seen and set(seen) == {True}, seen


def test_fused_adam_path_goes_to_the_release(monkeypatch):
    """With a FusedAdam (the step in the param groups) the wrappers hand every call to the release."""
    import torch

    import mcore_ckpt_fixes
    import megatron.core.optimizer.distrib_optimizer as m
    from mcore_ckpt_fixes.fixes.torch_adam_step.runtime import core

    mcore_ckpt_fixes.apply()
    opt, _, _ = core.optimizer_stand_in(torch)
    with pytest.raises(AssertionError):  # the release's torch branch on a fresh optimizer
        core.release_method_on_torch_adam(m.DistributedOptimizer, "state_dict")(opt)
    assert core.state_dict(opt)["optimizer"]["param_groups"][0]["step"] == 0.0
    monkeypatch.setattr(m, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(m, "USING_APEX_OPTIMIZER", True, raising=False)
    groups = core.state_dict(opt)["optimizer"]["param_groups"]
    assert "step" not in groups[0]  # FusedAdam's branch: no step in a group that has none


def test_own_step_tensors():
    import torch

    from mcore_ckpt_fixes.fixes.torch_adam_step.runtime.core import own_step_tensors

    shared = torch.tensor(3.0)
    states = [{"step": shared}, {"step": shared}, {"exp_avg": torch.zeros(1)}]
    own_step_tensors(states)
    assert states[0]["step"] is shared and states[1]["step"] is not shared
    assert float(states[1]["step"]) == 3.0
