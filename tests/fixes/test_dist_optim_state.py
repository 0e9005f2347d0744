"""dist-optim-state: both halves on every release line, in one warm world per half.

World 2 (DP=2, gloo on CPU), a one-layer GPT, Megatron's DDP and distributed optimizer (on the
FusedAdam path through the CPU stand-in of mcore_ckpt_fixes/testing/_fused_adam.py, or on torch's
Adam), saved and loaded with ``dist_checkpointing`` from requests built as third-party trainers build
them. See mcore_ckpt_fixes/fixes/dist_optim_state/checks/core.py. The fix-off half turns off this fix
only (torch-adam-step stays on, as a user has it, so that the torch Adam case shows this fix's defect).
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.dist_optim_state import FIX
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.dist_optim_state.checks.core"
MODULE = "megatron.core.optimizer.distrib_optimizer"
SCENARIOS = {s.name: s for s in for_fix(FIX.id)}
MOMENTS = ("moments", "AssertionError: the load restored no exp_avg, exp_avg_sq")
# What the fix-off half shows per case on the CI lines (0.16.0 and later: every defect is there).
UNPATCHED = {
    "fresh_request": MOMENTS,  # silent in the release: the check finds the moments missing
    "fresh_request_fully_reshardable": ("load_request", "KeyError: 'exp_avg'"),
    "fresh_request_torch_adam": MOMENTS,
    "no_metadata": ("save", "CheckpointingException: ShardedTensor.flattened_range is not supported."),
    "fp32_load": (
        "load",
        "RuntimeError: a view of a leaf Variable that requires grad is being used in an in-place operation.",
    ),
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    """Both halves, every case, one world each (cases share one save per kind of source)."""
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


@pytest.mark.parametrize("case", list(UNPATCHED))
def test_unpatched_shows_the_documented_failure(worlds, case, mcore_version):
    results = [r[case] for r in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == UNPATCHED[case], (rank, r.get("traceback"))
    if case in SCENARIOS:  # selftest's judgement agrees
        assert SCENARIOS[case].bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", ["fresh_save", "fresh_save_torch_adam"])
def test_unpatched_fresh_save_cannot_be_loaded(worlds, case):
    """A checkpoint saved before the first step holds no moments: Megatron's own load request
    (is_loading=True) asks for them and the load stops; the save itself left training untouched."""
    for rank, r in enumerate(w[case] for w in worlds[False]):
        assert r["phase"] == "load" and "exp_avg from model not in state dict" in r["error"], (rank, r["error"])
        unsaved = {k: d for k, d in r["max_delta"].items() if k.startswith("unsaved/")}
        assert unsaved and set(unsaved.values()) == {0.0}, (rank, unsaved)


@pytest.mark.parametrize("case", list(UNPATCHED) + ["fresh_save", "fresh_save_torch_adam"])
def test_patched_restores_the_whole_state_and_the_next_step_matches(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        deltas = r["max_delta"]
        # after the load: what was saved (the moments too, where the source had taken a step); after
        # one more step: the uninterrupted run's main parameters, moments and model parameters
        kinds = {"/".join(k.split("/")[:2]) if k.startswith(("next/", "unsaved/")) else k.split("/")[0] for k in deltas}
        fresh_save = case.startswith("fresh_save")
        saved = {"model", "main"} if fresh_save else {"model", "main", "exp_avg", "exp_avg_sq"}
        expected = saved | {f"next/{k}" for k in ("model", "main", "exp_avg", "exp_avg_sq")}
        if fresh_save:  # and the source, which saved before its first step, trained on as if it had not
            expected |= {f"unsaved/{k}" for k in ("model", "main", "exp_avg", "exp_avg_sq")}
        assert kinds == expected, (rank, kinds)
        assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})
        # A checkpoint saved before the first step leaves the optimizer as the source was: no state
        # (no zero moments either) until its first step, where Adam creates its own.
        assert r["not_saved"] == [], (rank, r["not_saved"])


def test_probe_finds_the_three_defects(mcore_version):
    import megatron.core.optimizer.distrib_optimizer as m
    from mcore_ckpt_fixes.fixes.dist_optim_state.runtime import core

    verdict, why = core.probe(m)  # the release's own methods, even after apply
    assert verdict is True and why.startswith("DistributedOptimizer: "), why
    assert sorted(core.defects(m)) == ["default_format", "fresh_request", "no_grad_load"], why


def test_calls_it_does_not_recognise_go_to_the_release():
    """A call the release's signature rejects is handed over as it came (the release raises its own
    TypeError), and a call that names its format keeps it."""
    import megatron.core.optimizer.distrib_optimizer as m
    from mcore_ckpt_fixes.engine.patching import original
    from mcore_ckpt_fixes.fixes.dist_optim_state.runtime import core

    release = original(m.DistributedOptimizer, "sharded_state_dict")
    assert core.bound_call(release, (object(),), {"no_such_argument": 1}) is None
    named = core.bound_call(release, (object(), {}), {"metadata": {"distrib_optim_sharding_type": "fully_reshardable"}})
    assert not core.names_no_format(named)
    assert core.names_no_format(core.bound_call(release, (object(), {}), {}))
    assert not core.names_no_format(core.bound_call(release, (object(), {}), {"sharding_type": "dp_reshardable"}))
