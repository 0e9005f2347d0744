"""Catalogue entry ``fsdp-dtensor-stage-local-layer-keys`` (NVIDIA/Megatron-LM#7452, open, silent):
an ``fsdp_dtensor`` checkpoint names transformer layers by their index within a pipeline stage, so a
run resumed with another pipeline-parallel size loads the first stage's layers into the later
stages without an error. Reproduced here through ``megatron.training`` on each line that ships it
(0.17 on), with and without the fixes (none covers it yet): the day a release or a fix changes the
outcome, this test says so and the catalogue entry must follow. See fsdp_dtensor_stage_keys.py for
what stands in for Megatron-FSDP and why.
"""

from __future__ import annotations

import os
import sys

import pytest

from mcore_ckpt_fixes.testing.launcher import run_world, values

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("fixes", ["off", "auto"])
def test_pp2_stage_1_loads_layer_0_of_a_pp1_fsdp_dtensor_checkpoint(fixes, mcore_version, tmp_path):
    if mcore_version.release[:2] < (0, 17):
        pytest.skip("megatron.training (fsdp_dtensor save and load) ships in the wheel from 0.17")
    sys.path.insert(0, HERE)
    try:
        out = values(
            run_world(
                "fsdp_dtensor_stage_keys:save_pp1_load_pp2",
                2,
                {"ckpt_dir": str(tmp_path)},
                env={
                    "MCORE_CKPT_FIXES": fixes,
                    "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
                },
                timeout=240,
            )
        )
    finally:
        sys.path.remove(HERE)
    assert [r["stage"] for r in out] == [0, 1], out
    first, second = out
    assert first["iteration"] == second["iteration"] == 1, out
    assert first["weights"] and all(w["own"] for w in first["weights"].values()), first
    # Stage 1's decoder.layers.0 is global layer 1; it got the checkpoint's layer 0 (the layer
    # norms, initialised to ones in both layers, match either way).
    proj = second["weights"]["module.decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj == {"own": False, "layer0": True}, second
