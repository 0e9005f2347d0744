"""float16-optim-fp32-params: both halves on every affected CI line, one warm world each.

World 2 (gloo on CPU, DP=2): Megatron's DDP and the non-distributed mixed-precision optimizer
(bf16, Float16OptimizerWithFloat16Params) over a bf16, an fp32 and a bf16 parameter in one group,
two steps, saved with dist_checkpointing and loaded into a run with other values; then one more step
on both. The fix-off half turns off this fix alone. See
mcore_ckpt_fixes/fixes/float16_optim_fp32_params/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.float16_optim_fp32_params import FIX
from mcore_ckpt_fixes.fixes.float16_optim_fp32_params.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.float16_optim_fp32_params.checks.core"
MODULE = "megatron.core.optimizer.optimizer"
NAMES = ("first", "kept_fp32", "last")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_save_pairs_the_fp32_state_with_another_parameter(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == ("save", sc.MISPAIRED.error), (rank, r["error"], r.get("traceback"))
        assert "optim_state_to_sharding_state" in r["traceback"], r["traceback"][-2000:]
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_every_parameter_loads_its_own_state_and_steps_on_exactly(worlds):
    expected = {
        f"{prefix}{kind}/{name}"
        for prefix in ("", "next/")
        for kind in ("param", "main", "exp_avg", "exp_avg_sq")
        for name in NAMES
    }
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert set(r["max_delta"]) == expected, sorted(r["max_delta"])
        assert set(r["max_delta"].values()) == {0.0}, r["max_delta"]


# -- the layer on stand-ins (no world) -------------------------------------------------------------


@pytest.fixture
def runtime():
    pytest.importorskip("megatron.core.optimizer.optimizer")
    from mcore_ckpt_fixes.fixes.float16_optim_fp32_params.runtime import core

    return core


@pytest.mark.one_line  # the layer on stand-ins, the same on every line
def test_layer_pairs_each_state_id_with_its_own_parameter(runtime):
    import megatron.core.optimizer.optimizer as module

    optimizer, model = runtime.stand_in(module.Float16OptimizerWithFloat16Params)
    state = runtime.sharded_state_dict(optimizer, model)
    keys = {i: entry["momentum_buffer"].key for i, entry in state["optimizer"]["state"].items()}
    assert keys == {0: "optimizer.state.momentum_buffer.half", 1: "optimizer.state.momentum_buffer.single"}
    ((copy,),) = state["fp32_from_fp16_params"]
    assert copy.key == "optimizer.state.fp32_param.half" and copy.data is optimizer.fp32_from_float16_groups[0][0]


@pytest.mark.one_line  # the layer on stand-ins, the same on every line
def test_groups_of_16_bit_copies_alone_take_the_release_path(runtime):
    import megatron.core.optimizer.optimizer as module

    optimizer, model = runtime.stand_in(module.Float16OptimizerWithFloat16Params)
    assert not runtime.only_fp32_copies(optimizer)
    optimizer.optimizer.param_groups[0]["params"].pop()  # the fp32 parameter out
    optimizer.fp32_from_fp32_groups = [[]]
    assert runtime.only_fp32_copies(optimizer)
