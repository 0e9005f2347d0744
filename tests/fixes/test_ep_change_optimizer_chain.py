"""ep-change-optimizer-chain: both halves on every affected CI line (see checks/core.py): fix off,
the EP=2 checkpoint's load under EP=1 stops on every rank with the release's KeyError; fix on, EP 2 -> 1
and back to 2 load every tensor as full tensors bit for bit, with the scheduler and the iteration,
and train on. Where the release has no such load (a chain of one saved and loaded: every other
layout) nothing changes: the resume check's configurations and layout changes cover that
(tests/resume)."""

import pytest
from conftest import needs_megatron_training
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain import FIX
from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.checks.core"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    needs_megatron_training()
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_ep_change_stops_the_load_on_every_rank(worlds, mcore_version):
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False]), [
        (r["phase"], r["error"]) for r in worlds[False]
    ]
    assert all(r["phase"] == "load" and r["error"] == sc.EP2_TO_EP1 for r in worlds[False])


def test_patched_ep_change_both_ways_is_exact_on_every_rank(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["iteration/moe-ep1-dp2"] == r["iteration/moe-ep2"] == 2, r
        # Two optimizers saved, one loaded and saved; then one saved, two loaded and saved.
        assert r["chain/moe-ep1-dp2"] == (2, 1) and r["chain/moe-ep2"] == (1, 2), r
        names = r["max_delta"]
        assert any(k.startswith("moe-ep1-dp2/") for k in names) and any(k.startswith("moe-ep2/") for k in names)
        assert any("exp_avg_sq" in k for k in names) and any("experts" in k for k in names), sorted(names)[:20]
        assert not {k: d for k, d in names.items() if d != 0.0}, rank


# -- the reshaping alone, on stand-ins: what it changes and what it leaves to the release -------------


def _chain(*kinds):
    """A stand-in chain: one optimizer per kind (True: expert groups, False: dense), each with a
    decay and a no-decay group."""
    from types import SimpleNamespace

    def groups(kind):
        return [{"params": [0], "wd_mult": w, "is_expert_parallel": kind} for w in (1.0, 0.0)]

    return SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups(k))) for k in kinds]
    )


def _saved(kind, step):
    groups = [{"wd_mult": w, "is_expert_parallel": kind, "step": step, "lr": 0.1} for w in (1.0, 0.0)]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}


def test_states_the_release_reads_as_they_are_are_left_alone():
    from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.runtime.core import in_chain_shape as shape

    one, two = _chain(False), _chain(False, True)
    flat = {**_saved(False, 3), "param_state": {"t": 1}}
    by_position = {0: {**_saved(False, 3), "param_state": {}}, 1: {**_saved(True, 3), "param_state": {}}}
    for chain, state in (
        (one, flat),
        (two, by_position),
        (two, [flat, flat]),
        (one, None),
        (two, {}),
        (one, {0: flat}),
    ):
        assert shape(chain, state) is None, state


def test_two_saved_optimizers_load_into_one():
    from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.runtime.core import in_chain_shape as shape

    mixed = {0: _saved(False, 5), 1: _saved(True, 5), "param_state": {"t": 1}}
    got = shape(_chain(False), mixed)
    assert got["param_state"] == {"t": 1} and got["param_state_sharding_type"] == "fully_reshardable"
    groups = got["optimizer"]["param_groups"]
    # The dense optimizer's own groups; the expert ones have the same overrides and add nothing.
    assert [(g["wd_mult"], g["is_expert_parallel"], g["step"]) for g in groups] == [(1.0, False, 5), (0.0, False, 5)]


def test_one_saved_optimizer_loads_into_two():
    from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.runtime.core import in_chain_shape as shape

    mixed = {**_saved(False, 7), 0: {"param_state": {"dense": 1}}, 1: {"param_state": {"expert": 1}}}
    got = shape(_chain(False, True), mixed)
    assert sorted(got) == [0, 1]
    assert got[0]["param_state"] == {"dense": 1} and got[1]["param_state"] == {"expert": 1}
    for part, kind in ((got[0], False), (got[1], True)):
        assert part["param_state_sharding_type"] == "fully_reshardable"
        assert [(g["wd_mult"], g["is_expert_parallel"], g["step"]) for g in part["optimizer"]["param_groups"]] == [
            (1.0, kind, 7),
            (0.0, kind, 7),
        ]
    assert mixed["optimizer"]["param_groups"][0]["is_expert_parallel"] is False  # the loaded dict is not changed
