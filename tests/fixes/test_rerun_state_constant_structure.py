"""rerun-state-constant-structure: both halves on the affected release lines (0.16.1, 0.17.1), one warm
world each; from 0.18 it is not needed.

World 2 (gloo on CPU): the real RerunStateMachine in VALIDATE_RESULTS mode with its own error
injector, driven as train_step drives it, saved at steady state and at the fault through one cached
save plan, resumed in a new machine: on 0.17.1 with megatron.training's save_checkpoint (one
checkpointing_context, --ckpt-assume-constant-structure) and load_checkpoint on the resume check's
small GPT; on 0.16.1 with the calls save_checkpoint makes (one TorchDistSaveShardedStrategy with
use_cached_ckpt_structure) and load_checkpoint's reading of the rerun state. See
mcore_ckpt_fixes/fixes/rerun_state_constant_structure/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.rerun_state_constant_structure import FIX
from mcore_ckpt_fixes.fixes.rerun_state_constant_structure.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.rerun_state_constant_structure.checks.core import FIELDS

CORE = "mcore_ckpt_fixes.fixes.rerun_state_constant_structure.checks.core"
MODULE = "megatron.core.rerun_state_machine"
SHARDS = ["rerun_state_machine_state/shard_0_2", "rerun_state_machine_state/shard_1_2"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _resume_code():
    from megatron.core import rerun_state_machine as rsm

    return rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE


def test_unpatched_fault_time_save_drops_the_rerun_state(worlds, mcore_version):
    resume = _resume_code()
    through = "megatron.training" if mcore_version.release >= (0, 17) else "dist_checkpointing"
    for rank, r in enumerate(worlds[False]):
        assert r["through"] == through, (rank, r["through"])
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert r["fault_exit"] == [True, True, resume], (rank, r["fault_exit"])
        assert r["saved"]["state"] == "WILL_RERUN_FROM_CHECKPOINT" and r["saved"]["checkpoint_requested"], r["saved"]
        # The steady-state save has no entry; the fault-time save its common part only.
        assert r["on_disk"] == [
            {"common_state": None, "sharded": []},
            {"common_state": "WILL_RERUN_FROM_CHECKPOINT", "sharded": []},
        ], (rank, r["on_disk"])
        assert (r["phase"], r["error"]) == (sc.DROPPED.phase, sc.DROPPED.error), (rank, r.get("raw_error"))
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_fault_time_save_keeps_the_rerun_state_and_resumes_the_rerun(worlds):
    resume = _resume_code()
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["on_disk"] == [
            {"common_state": "NOT_RUNNING_YET", "sharded": SHARDS},
            {"common_state": "WILL_RERUN_FROM_CHECKPOINT", "sharded": SHARDS},
        ], (rank, r["on_disk"])
        assert r["saved"]["state"] == "WILL_RERUN_FROM_CHECKPOINT", r["saved"]
        assert f"rank={rank}" in r["saved"]["failed_validation_call"], r["saved"]
        assert "'saved_microbatches': [1]" in r["saved"]["data_iterator_checkpoints"], r["saved"]
        for loaded in (r["loaded"], r["loaded_by_release"]):  # the fix changes no load request
            assert {k: loaded[k] for k in r["saved"]} == r["saved"], (rank, loaded)
            # The resumed step is the rerun from checkpoint: here on the same node and device,
            # which the machine recognises (it asks to be resumed again elsewhere).
            assert (loaded["resumed_exit"], loaded["resumed_state"]) == (
                [False, True, resume],
                "RERUNNING_AGAIN_FROM_CHECKPOINT",
            ), (rank, loaded)
        # The steady-state entry is ignored on load, by this release as by 0.18+.
        steady = r["steady_by_release"]
        assert (steady["state"], steady["failed_validation_call"], steady["resumed_exit"]) == (
            "NOT_RUNNING_YET",
            "None",
            [False, False, 0],
        ), (rank, steady)
        if r["through"] == "megatron.training":
            assert r["iteration"] == 2, r["iteration"]
            assert r["n_tensors"] > 1 and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        else:
            assert r["max_delta"] == {"model/w": 0.0}, r["max_delta"]
    assert set(FIELDS) <= set(worlds[True][0]["saved"])


def test_disabled_machine_and_other_formats_save_as_the_release(mcore_version):
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import mcore_ckpt_fixes

    mcore_ckpt_fixes.apply()
    from megatron.core import rerun_state_machine as rsm

    assert rsm.RerunStateMachine(mode=rsm.RerunMode.DISABLED).state_dict(None, "torch_dist") is None
    validating = rsm.RerunStateMachine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    assert validating.state_dict(None, "torch") is None
    assert validating.state_dict(None, "fsdp_dtensor") is None
