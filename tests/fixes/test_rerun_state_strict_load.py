"""rerun-state-strict-load: both halves on every CI line (0.16.1 through dist_checkpointing; 0.17.1,
0.18.2 and 0.19.2 also through megatron.training), one warm world each.

World 2 (gloo on CPU): a torch_dist checkpoint holding the rerun state machine's idle entry (as 0.18+
writes it at every save, and rerun-state-constant-structure on 0.14-0.17), loaded as load_checkpoint
builds the request (the entry left out) under every --dist-ckpt-strictness value, then with the
entry asked for; and save_checkpoint / load_checkpoint with raise_all. The fix-off half turns off
this fix alone: on 0.17.1 rerun-state-constant-structure stays on and writes the entry, which is
what a checkpoint of 0.18+ brings to 0.17 too. See
mcore_ckpt_fixes/fixes/rerun_state_strict_load/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.rerun_state_strict_load import FIX
from mcore_ckpt_fixes.fixes.rerun_state_strict_load.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.rerun_state_strict_load.checks.core import STRICTNESS

CORE = "mcore_ckpt_fixes.fixes.rerun_state_strict_load.checks.core"
MODULE = "megatron.core.dist_checkpointing.validation"
ENTRY = ["rerun_state_machine_state"]
# What the release does with an idle entry left out of the request: the *_all values compare the
# request with the whole checkpoint.
RELEASE = {
    "assume_ok_unexpected": "ok",
    "log_unexpected": "ok",
    "log_all": "ok",  # with a warning naming the key
    "raise_unexpected": "ok",
    "raise_all": sc.REJECTED.error,
    "return_unexpected": {"missing": [], "unexpected": []},
    "return_all": {"missing": ENTRY, "unexpected": []},
    "ignore_all": "ok",
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _through(mcore_version):
    return "megatron.training" if mcore_version.release >= (0, 17) else "dist_checkpointing"


def test_unpatched_raise_all_rejects_the_ignored_rerun_state(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["through"] == _through(mcore_version), (rank, r["through"])
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.REJECTED.phase, sc.REJECTED.error), (rank, r.get("raw_error"))
        assert r["outcomes"] == RELEASE, (rank, r["outcomes"])
        # Every value that loads loads the model exactly, and so does the load that asks for the entry.
        assert set(r["max_delta"].values()) == {0.0} and len(r["max_delta"]) == len(STRICTNESS), r["max_delta"]
        assert r["pending_rerun_state"] == "NOT_RUNNING_YET", r
        if r["through"] == "megatron.training":
            assert r["training_entry_on_disk"] is True, r
            assert r["training_load"] == f"load: {sc.REJECTED.error}", (rank, r["training_load"])
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_every_strictness_loads(worlds, mcore_version):
    patched = dict(RELEASE, raise_all="ok", return_all={"missing": [], "unexpected": []})
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["outcomes"] == patched, (rank, r["outcomes"])
        assert r["pending_rerun_state"] == "NOT_RUNNING_YET", r
        if r["through"] == "megatron.training":
            assert r["training_entry_on_disk"] is True and r["training_load"] == "ok", r
            assert r["iteration"] == 1, r["iteration"]
            assert any(k.startswith("gpt/") for k in r["max_delta"]), r["max_delta"]
        assert set(r["max_delta"].values()) == {0.0}, r["max_delta"]


def test_probe_leaves_code_it_cannot_judge_alone():
    """A mismatch check with another signature (upstream reworked it): not judged, not failed."""
    from mcore_ckpt_fixes.fixes.rerun_state_strict_load.runtime import core

    def reworked(ckpt_sharded_metadata, local_metadata, global_metadata, strict):
        raise AssertionError("not called this way")

    verdict, why = core.probe(_module(reworked))
    assert verdict is None and "could not be judged" in why, why


def _module(fn):
    import types

    mod = types.ModuleType("stand_in_validation")
    mod._determine_missing_and_unexpected_keys = fn
    return mod
