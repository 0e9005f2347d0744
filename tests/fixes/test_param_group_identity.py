"""param-group-identity: both halves on every affected release line (0.16.1, 0.17.1, 0.18.2, 0.19.2),
one warm world each.

World 2 (DP=2, gloo on CPU), a one-layer GPT, Megatron's DDP and ``get_megatron_optimizer``'s
distributed optimizer: with a decoupled learning rate (three parameter groups, two of them alike
but for ``max_lr``: defect (a), 0.16-0.18), and saved with one ``--lr`` and loaded with another
(defect (b), 0.19), on the FusedAdam path (the CPU stand-in of mcore_ckpt_fixes/testing/_fused_adam.py),
saved and loaded with ``dist_checkpointing``. See mcore_ckpt_fixes/fixes/param_group_identity/checks/core.py.
"""

import warnings

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.param_group_identity import FIX
from mcore_ckpt_fixes.fixes.param_group_identity.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.param_group_identity.checks.core"
MODULE = "megatron.core.optimizer.optimizer"
DISTRIB = "megatron.core.optimizer.distrib_optimizer"
BASE = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _case(worlds, patched, case):
    return [w[case] for w in worlds[patched]]


def _before_019(version):
    from packaging.version import Version

    return version < Version("0.19.0")


def _exact(rank, r):
    assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
    loads = {k.split("/")[0] for k in r["max_delta"]}  # the ChainedOptimizer's, the DistributedOptimizer's alone
    kinds = {k.split("/")[1] for k in r["max_delta"]}
    assert (loads, kinds) == ({"chained", "alone"}, {"model", "main", "exp_avg", "exp_avg_sq"}), (loads, kinds)
    assert set(r["max_delta"].values()) == {0.0}, {k: d for k, d in r["max_delta"].items() if d}


def test_unpatched_gives_two_groups_one_saved_group_before_019(worlds, mcore_version):
    results = _case(worlds, False, "decoupled_lr")
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled", DISTRIB: "disabled"}, (rank, r)
        if not _before_019(mcore_version):  # 0.19 matches such groups by max_lr itself
            _exact(rank, r)
            continue
        assert (r["phase"], r["error"]) == (sc.ONE_SAVED_GROUP.phase, sc.ONE_SAVED_GROUP.error), (
            rank,
            r.get("traceback"),
        )
    if _before_019(mcore_version):
        assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(results)


def test_unpatched_refuses_a_changed_learning_rate_from_019(worlds, mcore_version):
    results = _case(worlds, False, "changed_lr")
    for rank, r in enumerate(results):
        if _before_019(mcore_version):  # the keys hold no learning rate: the release loads it
            _exact(rank, r)
            continue
        assert (r["phase"], r["error"]) == (sc.NO_SAVED_GROUP.phase, sc.NO_SAVED_GROUP.error), (
            rank,
            r.get("traceback"),
        )
    if not _before_019(mcore_version):
        assert sc.SCENARIOS[1].bug_for(mcore_version).seen_in(results)


def test_patched_a_changed_learning_rate_loads_each_groups_own_state(worlds):
    for rank, r in enumerate(_case(worlds, True, "changed_lr")):
        assert r["fix_state"] == {MODULE: "applied", DISTRIB: "applied"}, (rank, r["fix_state"])
        # The groups (weight decay on, off) come back with the saved bounds: the scheduler sets them.
        assert [tuple(lrs) for lrs in r["lrs"]] == [(0.01, None), (0.01, None)], r["lrs"]
        _exact(rank, r)


def test_patched_every_group_resumes_with_its_own_learning_rates(worlds):
    for rank, r in enumerate(_case(worlds, True, "decoupled_lr")):
        assert r["fix_state"] == {MODULE: "applied", DISTRIB: "applied"}, (rank, r["fix_state"])
        assert [tuple(lrs) for lrs in r["lrs"]] == [(0.01, 0.001), (0.03, 0.001), (0.01, 0.001)], r["lrs"]
        _exact(rank, r)


def _group(max_lr, wd_mult=1.0, **extra):
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
            "max_lr": max_lr, "min_lr": 0.0, **extra}  # fmt: skip


def _release_keys():
    import megatron.core.optimizer.optimizer as m

    return tuple(tuple.__iter__(m.param_group_identifier_keys))


def test_keys_lose_the_learning_rate_bounds_only_where_they_changed(mcore_version):
    """0.19: the release's keys hold max_lr and min_lr."""
    if _before_019(mcore_version):
        pytest.skip("before 0.19 the identifier keys hold no learning rate")
    import mcore_ckpt_fixes  # noqa: F401  (applies the fix: the release's keys are recorded)
    from mcore_ckpt_fixes.fixes.param_group_identity.runtime.core import _param_group_identifier_keys_for as keys

    release = _release_keys()
    assert {"max_lr", "min_lr"} <= set(release), release
    without = tuple(k for k in release if k not in ("max_lr", "min_lr"))
    saved = [_group(0.01), _group(0.01, wd_mult=0.0)]
    assert keys(saved, saved) == release
    assert keys([_group(0.02), _group(0.02, wd_mult=0.0)], saved) == without  # --lr changed
    assert keys([_group(0.02, min_lr=0.1), _group(0.02, wd_mult=0.0, min_lr=0.1)], saved) == without
    # Groups that differ only in max_lr (overrides) cannot be told apart without it: the release's keys.
    alike = [_group(0.01), _group(0.03)]
    assert keys([_group(0.02), _group(0.05)], alike) == release
    assert keys(alike, alike) == release


def test_a_changed_learning_rate_among_groups_alike_but_for_it_is_still_refused(mcore_version):
    """0.19, groups alike but for max_lr (two overrides), one of them changed: no key tells which
    saved group is whose, so the release's refusal stands."""
    if _before_019(mcore_version):
        pytest.skip("before 0.19 the identifier keys hold no learning rate")
    import mcore_ckpt_fixes
    import megatron.core.optimizer.optimizer as m

    mcore_ckpt_fixes.apply()
    current = [dict(_group(0.01), params=[0]), dict(_group(0.05), params=[1])]
    saved = [dict(_group(0.01), params=[0]), dict(_group(0.03), params=[1])]
    with pytest.raises(ValueError, match="Could not find parameter group"):
        m.MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    current = [dict(_group(0.02), params=[0]), dict(_group(0.02, wd_mult=0.0), params=[1])]
    saved = [dict(_group(0.01), params=[0]), dict(_group(0.01, wd_mult=0.0), params=[1])]
    out = m.MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert [(g["max_lr"], g["wd_mult"], g["params"]) for g in out] == [(0.01, 1.0, [0]), (0.01, 0.0, [1])]


def test_keys_only_grow_where_the_release_leaves_groups_alike(mcore_version):
    if mcore_version not in FIX.specifiers or not _before_019(mcore_version):
        pytest.skip("0.16-0.18: the identifier keys hold no override")
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
    if mcore_version not in FIX.specifiers or not _before_019(mcore_version):
        pytest.skip("0.16-0.18: the identifier keys hold no override")
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
    release = _release_keys()
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def loading():
        with core.matching_by_keys(release + ("chosen",)):
            seen["loading"] = tuple(m.param_group_identifier_keys)
            inside.set()
            done.wait(30)

    t = threading.Thread(target=loading)
    t.start()
    assert inside.wait(30)
    seen["other"] = tuple(d.param_group_identifier_keys)
    done.set()
    t.join(30)
    assert seen == {"loading": release + ("chosen",), "other": release}, seen
    assert tuple(m.param_group_identifier_keys) == release
