"""rerun-transient-checkpoint: both halves on the affected release lines (0.16.1, 0.17.1), one warm
world each; from 0.18 it is not needed (no checkpoint at that exit).

World 2 (gloo on CPU): the real RerunStateMachine in VALIDATE_RESULTS mode with its own error
injector set to a transient error, driven as train_step drives it; the checkpoint it asks for at the
fault is saved and a new machine resumes from it and runs the next step: on 0.17.1 with
megatron.training's save_checkpoint and load_checkpoint on the resume check's small GPT; on 0.16.1
with the calls they make. See mcore_ckpt_fixes/fixes/rerun_transient_checkpoint/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.rerun_transient_checkpoint import FIX
from mcore_ckpt_fixes.fixes.rerun_transient_checkpoint.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.rerun_transient_checkpoint.runtime.core import IGNORED

CORE = "mcore_ckpt_fixes.fixes.rerun_transient_checkpoint.checks.core"
MODULE = "megatron.core.rerun_state_machine"
SHARDS = ["rerun_state_machine_state/shard_0_2", "rerun_state_machine_state/shard_1_2"]
# The machine as the job configured it, and after a regular step: nothing pending, no fault.
FRESH = {
    "state": "NOT_RUNNING_YET",
    "rerun_requested": False,
    "checkpoint_requested": False,
    "restart_again_requested": False,
    "continue_requested": False,
    "failed_validation_call": "None",
    "initial_result": None,
    "suspicious_node": None,
    "suspicious_device": None,
    "data_iterator_checkpoints": "None",
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _failed_code():
    from megatron.core import rerun_state_machine as rsm

    return rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION


def _fresh():
    """The view of a machine as the job configures it (its start iteration is the release's)."""
    from megatron.core import rerun_state_machine as rsm

    return dict(FRESH, current_iteration=rsm.RerunStateMachine(mode=rsm.RerunMode.VALIDATE_RESULTS).current_iteration)


def _through(mcore_version):
    return "megatron.training" if mcore_version.release >= (0, 17) else "dist_checkpointing"


def test_unpatched_resume_from_the_transient_fault_checkpoint_crashes(worlds, mcore_version):
    failed = _failed_code()
    for rank, r in enumerate(worlds[False]):
        assert r["through"] == _through(mcore_version), (rank, r["through"])
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        (case,) = r["cases"].values()
        # The release asks for a checkpoint and exit at the transient fault, in RERUNNING_IN_PLACE...
        assert case["fault_exit"] == [True, True, failed], (rank, case["fault_exit"])
        assert case["saved"]["state"] == "RERUNNING_IN_PLACE", (rank, case["saved"])
        assert not case["saved"]["checkpoint_requested"] and not case["saved"]["continue_requested"], case["saved"]
        assert case["on_disk"] == {"common_state": "RERUNNING_IN_PLACE", "sharded": SHARDS}, (rank, case["on_disk"])
        # ...the resumed machine is restored in it, and its first step restores a snapshot never saved.
        assert case["loaded"]["state"] == "RERUNNING_IN_PLACE", (rank, case["loaded"])
        assert (r["phase"], r["error"]) == (sc.CRASH.phase, sc.CRASH.error), (rank, r.get("traceback"))
        assert "_restore_state" in r["traceback"], r["traceback"]
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_checkpoint_resumes_training(worlds, mcore_version):
    failed, fresh = _failed_code(), _fresh()
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["through"] == _through(mcore_version), (rank, r["through"])
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert set(r["cases"]) == {"exit", "old"}, r["cases"]
        for name, case in r["cases"].items():
            # The release's exit: checkpoint and exit code 17 at the transient fault.
            assert case["fault_exit"] == [True, True, failed], (rank, name, case["fault_exit"])
            # The resumed machine is the job's own, nothing pending; its next step is a regular one.
            assert case["loaded"] == fresh, (rank, name, case["loaded"])
            assert (case["resumed_exit"], case["resumed_state"]) == ([False, False, 0], "NOT_RUNNING_YET"), case
            if r["through"] == "megatron.training":
                assert case["iteration"] == 1, (rank, name, case["iteration"])
        exit_, old = r["cases"]["exit"], r["cases"]["old"]
        # With the fix the checkpoint holds no pending rerun (rerun-state-constant-structure, on by
        # default, writes the steady-state entry), and its load warns of nothing.
        assert exit_["saved"]["state"] == "NOT_RUNNING_YET", (rank, exit_["saved"])
        assert f"rank={rank}" in exit_["saved"]["failed_validation_call"], exit_["saved"]
        assert exit_["on_disk"] == {"common_state": "NOT_RUNNING_YET", "sharded": SHARDS}, (rank, exit_["on_disk"])
        assert exit_["warnings"] == [], (rank, exit_["warnings"])
        # What an unfixed release wrote is ignored on load, with one warning.
        assert old["saved"]["state"] == "RERUNNING_IN_PLACE", (rank, old["saved"])
        assert old["on_disk"] == {"common_state": "RERUNNING_IN_PLACE", "sharded": SHARDS}, (rank, old["on_disk"])
        assert len(old["warnings"]) == 1 and old["warnings"][0].endswith(IGNORED), (rank, old["warnings"])
        # The model, exact, from both checkpoints.
        assert r["n_tensors"] > 1 and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert {k.split("/")[0] for k in r["max_delta"]} == {"exit", "old"}, r["max_delta"]
