"""fsdp-dtensor-pp-guard: both halves on every line that ships megatron.training (0.17.1, 0.18.2,
0.19.2), one warm world each.

World 2 (gloo on CPU): megatron.training's fsdp_dtensor save of a 2-layer GPT with PP=1 (DP=2), its
load with PP=2, then with PP=1 again; plain DDP stands in for Megatron-FSDP, whose buffers need CUDA
(see mcore_ckpt_fixes/fixes/fsdp_dtensor_pp_guard/checks/core.py). Without the fix stage 1 resumes
with the checkpoint's layer 0 in place of its own layer 1, and nothing says so; with it the PP=2
load is refused with one line on every rank, and the same-layout load is exact.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard import FIX
from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.checks.core"
MODULE = "megatron.training.checkpointing"
REFUSAL = (
    "CKPT/iter_0000001: this fsdp_dtensor checkpoint names each transformer layer by its index within its "
    "pipeline stage and was saved with pipeline_model_parallel_size=1; this run has "
    "pipeline_model_parallel_size=2, so its stages would load other stages' layers without an error. Resume "
    "it with the pipeline layout it was saved with (or convert it to torch_dist with that layout first: "
    "torch_dist names layers by their global number)"
)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    if mcore_version.release[:2] < (0, 17):
        pytest.skip("megatron.training (the fsdp_dtensor save and load) ships in the wheel from 0.17")
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_stage_1_resumes_with_layer_0(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert r["refusal"] is None, (rank, r["refusal"])
        assert (r["phase"], r["error"]) == (sc.OTHER_STAGES_LAYERS.phase, sc.OTHER_STAGES_LAYERS.error), (
            rank,
            r.get("traceback"),
        )
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_refuses_the_other_layout_and_loads_the_same_one_exactly(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["refusal"] == REFUSAL, (rank, r["refusal"])
        assert r["max_delta"] and set(r["max_delta"].values()) == {0.0}, r["max_delta"]


def test_the_run_that_takes_the_checkpoint_s_layout_is_not_refused():
    """``--use-checkpoint-args``: the run's layout comes from the checkpoint (load_args_from_checkpoint
    reads the arguments before they are final), so nothing is compared."""
    import types

    from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.runtime.core import _refuse_fsdp_dtensor_pipeline_change as refuse

    saved = {"args": types.SimpleNamespace(pipeline_model_parallel_size=1)}
    refuse(saved, types.SimpleNamespace(pipeline_model_parallel_size=2, use_checkpoint_args=True), "c")
    refuse(saved, types.SimpleNamespace(pipeline_model_parallel_size=1, use_checkpoint_args=False), "c")
    refuse({"args": None}, types.SimpleNamespace(pipeline_model_parallel_size=2), "c")
    with pytest.raises(ValueError, match="^c: this fsdp_dtensor checkpoint"):
        refuse(saved, types.SimpleNamespace(pipeline_model_parallel_size=2, use_checkpoint_args=False), "c")
