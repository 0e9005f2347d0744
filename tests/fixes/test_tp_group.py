"""tp-group: both halves on every release line, real Megatron-Core modules, real dist_checkpointing.

World 2, TP=2, gloo on CPU, models built from an explicit ProcessGroupCollection (parallel_state
never initialised). Stand-in used: ``mamba_ssm`` (CUDA/Triton kernels that cannot be installed on
a CPU host), see mcore_ckpt_fixes/scenarios/tp_group.py for exactly what it replaces and why.
"""

import pytest

from mcore_ckpt_fixes.fixes.tp_group import FIX
from mcore_ckpt_fixes.harness.launcher import run_world, values

SCENARIOS = ("mamba_stack", "mamba_mixer", "radio_vit")
# The first assertion each model hits without the fix. A lone MambaMixer differs: with
# parallel_state uninitialised its group-less helper call passes tp_group=None through and the
# dp-cp lookup asserts first; in a stack (and in RADIO) MegatronModule.sharded_state_dict asks
# parallel_state for the TP group before that.
UNPATCHED_ERROR = {
    "mamba_stack": "AssertionError: tensor model parallel group is not initialized",
    "mamba_mixer": "AssertionError: data parallel group with context parallel combined is not initialized",
    "radio_vit": "AssertionError: tensor model parallel group is not initialized",
}


@pytest.fixture(scope="module", autouse=True)
def warm_parent():
    """Import everything once here: every world below is forked from this process."""
    from mcore_ckpt_fixes.scenarios import tp_group as scenarios

    scenarios.install_mamba_ssm_stand_in()
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.vision.radio  # noqa: F401
    import megatron.core.ssm.mamba_block  # noqa: F401
    import megatron.core.ssm.mamba_mixer  # noqa: F401


def _run(name, patched, tmp_path):
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    return values(
        run_world(
            f"mcore_ckpt_fixes.scenarios.tp_group:{name}",
            2,
            {"ckpt_dir": str(tmp_path), "patched": patched},
            env=env,
            timeout=240,
        )
    )


@pytest.mark.parametrize("name", SCENARIOS)
def test_unpatched(name, tmp_path, mcore_version):
    results = _run(name, False, tmp_path)
    if mcore_version in FIX.specifiers:
        for rank, r in enumerate(results):
            assert r["phase"] == "sharded_state_dict", (rank, r)
            assert r["error"] == UNPATCHED_ERROR[name], (rank, r["error"])
    else:  # fixed upstream: the fix is off and the round trip is exact anyway
        for rank, r in enumerate(results):
            assert r["error"] is None, (rank, r.get("traceback"))
            assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r)


@pytest.mark.parametrize("name", SCENARIOS)
def test_patched_round_trip_is_exact(name, tmp_path, mcore_version):
    results = _run(name, True, tmp_path)
    expected_state = "applied" if mcore_version in FIX.specifiers else "not-needed"
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert set(r["fix_state"].values()) == {expected_state}, (rank, r["fix_state"])


def test_classic_parallel_state_models_identical(tmp_path):
    results = values(
        run_world(
            "mcore_ckpt_fixes.scenarios.tp_group_classic:classic_models_identical",
            2,
            {"ckpt_dir": str(tmp_path)},
            timeout=240,
        )
    )
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            assert r["descriptions_equal"] and r["values_equal"], (rank, name, r)
            assert r["n_sharded"] > 0 and r["round_trip_max_delta"] == 0.0, (rank, name, r)
