"""param-group-identity: both halves on every affected release line (0.16.1, 0.17.1, 0.18.2), one
warm world each; on 0.19.2 it is not needed.

World 2 (DP=2, gloo on CPU), a one-layer GPT, Megatron's DDP and ``get_megatron_optimizer``'s
distributed optimizer with a decoupled learning rate (three parameter groups, two of them alike
but for ``max_lr``), on the FusedAdam path (the CPU stand-in of mcore_ckpt_fixes/testing/_fused_adam.py),
saved and loaded with ``dist_checkpointing``. See mcore_ckpt_fixes/fixes/param_group_identity/checks/core.py.
"""

import warnings

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.param_group_identity import FIX
from mcore_ckpt_fixes.fixes.param_group_identity.checks import scenarios as sc
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.param_group_identity.checks.core"
MODULE = "megatron.core.optimizer.optimizer"
DISTRIB = "megatron.core.optimizer.distrib_optimizer"
BASE = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(
        FIX, f"{CORE}:round_trip", {"MCORE_CKPT_FIX_PARAM_GROUP_IDENTITY": "off"}, tmp_path_factory, mcore_version
    )


def test_registry():
    (s,) = for_fix(FIX.id)
    assert (s.name, s.func, s.nproc) == ("decoupled_lr", f"{CORE}:round_trip", 2)
    assert s.bug[">=0.16.0,<0.19.0"] is sc.ONE_SAVED_GROUP


def test_unpatched_gives_two_groups_one_saved_group(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled", DISTRIB: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.ONE_SAVED_GROUP.phase, sc.ONE_SAVED_GROUP.error), (
            rank,
            r.get("traceback"),
        )
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_every_group_resumes_with_its_own_learning_rates(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied", DISTRIB: "applied"}, (rank, r["fix_state"])
        assert [tuple(lrs) for lrs in r["lrs"]] == [(0.01, 0.001), (0.03, 0.001), (0.01, 0.001)], r["lrs"]
        loads = {k.split("/")[0] for k in r["max_delta"]}  # the ChainedOptimizer's, the DistributedOptimizer's alone
        kinds = {k.split("/")[1] for k in r["max_delta"]}
        assert (loads, kinds) == ({"chained", "alone"}, {"model", "main", "exp_avg", "exp_avg_sq"}), (loads, kinds)
        assert set(r["max_delta"].values()) == {0.0}, {k: d for k, d in r["max_delta"].items() if d}


def _group(max_lr, wd_mult=1.0, **extra):
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
            "max_lr": max_lr, "min_lr": 0.0, **extra}  # fmt: skip


def test_keys_only_grow_where_the_release_leaves_groups_alike(mcore_version):
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import mcore_ckpt_fixes  # noqa: F401  (applies the fix: the release's keys are recorded)
    import megatron.core.optimizer.optimizer  # noqa: F401
    from mcore_ckpt_fixes.fixes.param_group_identity.runtime.core import _param_group_identifier_keys_for as keys

    distinct = [_group(0.01), _group(0.01, wd_mult=0.0)]
    assert keys(distinct, distinct) == BASE  # the release tells them apart: its own keys
    alike = [_group(0.01), _group(0.03)]
    assert keys(alike, alike) == BASE + ("max_lr", "min_lr")
    # An override changed since the save (0.03 -> 0.05): no saved group for it; the release's keys.
    assert keys([_group(0.01), _group(0.05)], alike) == BASE
    # A key some group lacks is not used.
    assert keys(alike, [_group(0.01), {k: v for k, v in _group(0.03).items() if k != "min_lr"}]) == BASE + ("max_lr",)


def test_changed_override_keeps_the_release_matching_and_warns(mcore_version):
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import mcore_ckpt_fixes
    import megatron.core.optimizer.optimizer as m
    from mcore_ckpt_fixes.engine.errors import MegatronPatchWarning

    mcore_ckpt_fixes.apply()
    current = [dict(_group(0.01), params=[0]), dict(_group(0.05), params=[1])]
    saved = [dict(_group(0.01), params=[0]), dict(_group(0.03), params=[1])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = m.MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert [g["max_lr"] for g in out] == [0.03, 0.03]  # what the release does
    assert [w for w in caught if issubclass(w.category, MegatronPatchWarning)], [str(w.message) for w in caught]
    assert m.param_group_identifier_keys == BASE and tuple(m.param_group_identifier_keys) == BASE


def test_chosen_keys_are_the_loading_context_s_only(mcore_version):
    """While one thread loads with the longer keys, another thread's matching iterates the
    release's: nothing is swapped in the module for the length of a call."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import threading

    import mcore_ckpt_fixes
    import megatron.core.optimizer.distrib_optimizer as d
    import megatron.core.optimizer.optimizer as m
    from mcore_ckpt_fixes.fixes.param_group_identity.runtime import core

    mcore_ckpt_fixes.apply()
    assert m.param_group_identifier_keys is d.param_group_identifier_keys
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def loading():
        with core._matching_by(BASE + ("max_lr",)):
            seen["loading"] = tuple(m.param_group_identifier_keys)
            inside.set()
            done.wait(30)

    t = threading.Thread(target=loading)
    t.start()
    assert inside.wait(30)
    seen["other"] = tuple(d.param_group_identifier_keys)
    done.set()
    t.join(30)
    assert seen == {"loading": BASE + ("max_lr",), "other": BASE}, seen
    assert tuple(m.param_group_identifier_keys) == BASE


def test_probe(mcore_version):
    import megatron.core.optimizer.optimizer as m
    from mcore_ckpt_fixes.fixes.param_group_identity.runtime import core

    verdict, why = core.probe(m)
    assert verdict is (mcore_version in FIX.specifiers), why
