"""float16-optim-fresh-save: both halves on every affected CI line (see checks/core.py).

World 2 (gloo on CPU, DP=2): the non-distributed fp16 optimizer whose first step the loss scaler
skips, saved before any Adam step and loaded into another run, on Apex FusedAdam's path and on
torch's Adam; and a source that stepped, where the release works. One world per half, every case in it.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.float16_optim_fresh_save import FIX, MODULE
from mcore_ckpt_fixes.fixes.float16_optim_fresh_save.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.float16_optim_fresh_save.checks.core"
FRESH = [s.name for s in sc.SCENARIOS]
KINDS = {"param", "main", "loss_scale"}
NEXT_KINDS = KINDS | {"exp_avg", "exp_avg_sq"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _kinds(r, prefix=""):
    """The kinds of values compared after the load (``prefix`` ""), or after the next step ("next/")."""
    keys = [k for k in r["max_delta"] if k.startswith(prefix) and (prefix or not k.startswith("next/"))]
    return {key[len(prefix) :].split("/")[0] for key in keys}


@pytest.mark.parametrize("case", FRESH)
def test_unpatched_the_load_asks_for_moments_the_save_did_not_write(worlds, case, mcore_version):
    bug = sc.SCENARIOS[FRESH.index(case)].bug_for(mcore_version)
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert r["stepped"] is False and r["source_holds_state"] is False, (rank, r)
        assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r["phase"], r.get("traceback"))
    assert bug.seen_in(results)


@pytest.mark.parametrize("case", FRESH)
def test_patched_the_resumed_run_is_the_uninterrupted_one(worlds, case):
    for rank, w in enumerate(worlds[True]):
        r = w[case]
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        # Loaded as the source was: no optimizer state (the source's first step was skipped).
        assert r["stepped"] is False and r["source_holds_state"] is False and r["target_holds_state"] is False, r
        assert r["next_stepped"] == [True, True], (rank, r["next_stepped"])
        assert _kinds(r) == KINDS and NEXT_KINDS <= _kinds(r, "next/"), (rank, sorted(r["max_delta"]))
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: v for k, v in r["max_delta"].items() if v})


def test_where_the_release_works_both_halves_are_exact_and_the_same(worlds):
    """A source that stepped before its save: the release's round trip is exact, and with the fix the
    same bits (every value, each rank's digests of what was saved and loaded)."""
    halves = [[w["stepped_torch_adam"] for w in worlds[patched]] for patched in (False, True)]
    for results in halves:
        for rank, r in enumerate(results):
            assert r["error"] is None and r["stepped"] is True and r["target_holds_state"] is True, (rank, r)
            assert NEXT_KINDS <= _kinds(r) and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
    assert [r["digests"] for r in halves[0]] == [r["digests"] for r in halves[1]]
