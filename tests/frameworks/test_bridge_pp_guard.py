"""fsdp-dtensor-pp-guard in Megatron-Bridge 0.6.2's own checkpointing.

Real: Megatron-Bridge (installed from tools/frameworks/megatron-bridge.txt), its ``save_checkpoint``
and ``load_checkpoint`` (``_load_checkpoint_from_path``, ``read_run_config``,
``load_fsdp_dtensor_checkpoint``, ``preprocess_fsdp_dtensor_state_dict``, DCP) with a real Bridge
``ConfigContainer`` / ``GlobalState``, a 2-layer Megatron-Core ``GPTModel`` per pipeline stage, 2
forked ranks on gloo. What each world does: mcore_ckpt_fixes/fixes/fsdp_dtensor_pp_guard/checks/bridge.py.

Stand-ins: Megatron-FSDP (its wrapper needs a CUDA device: the plain model's state dict goes through
Bridge's fsdp_dtensor branches, same stage-local keys) and, to import Bridge, the Transformer Engine
stand-in of mcore_ckpt_fixes/testing/_standins.py (nothing of it runs).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import types

import pytest

from conftest import run_py
from framework_import import import_framework
from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard import FIX
from mcore_ckpt_fixes.testing.launcher import run_world, values

FRAMEWORK = "megatron-bridge"
BRIDGE = "megatron.bridge.training.checkpointing"
RT = "mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.checks.bridge:pp1_to_pp2"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH = os.path.join(ROOT, "patches", FIX.id, "megatron-bridge-0.6.2.patch")
REFUSAL = (
    "CKPT/iter_0000001: this fsdp_dtensor checkpoint names each transformer layer by its index within its "
    "pipeline stage and was saved with pipeline_model_parallel_size=1; this run has "
    "pipeline_model_parallel_size=2, so its stages would load other stages' layers without an error. "
    "Resume it with the pipeline layout it was saved with (or convert it to torch_dist with that layout "
    "first: torch_dist names layers by their global number)"
)
WRONG_LAYERS = (
    "AssertionError: stage 1's decoder.layers.0 (global layer 1) holds the checkpoint's layer 0 after a "
    "PP=2 load of a PP=1 checkpoint"
)


@pytest.fixture(scope="module", autouse=True)
def bridge():
    """Bridge imported in the warm parent (the forked ranks inherit it), after the fix's hooks."""
    from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    module = import_framework(FRAMEWORK, BRIDGE)
    from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.checks.bridge import prepare

    prepare()
    return module


def _world(tmp_path, patched, ckpt_format="fsdp_dtensor"):
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    kwargs = {"ckpt_dir": str(tmp_path), "patched": patched, "ckpt_format": ckpt_format}
    return values(run_world(RT, 2, kwargs, env=env, timeout=240))


def _exact(r):
    assert r["n_tensors"] == 24 and set(r["max_delta"].values()) == {0.0}, r["max_delta"]


_STATUS = """
import json, os
import mcore_ckpt_fixes
from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge
install_transformer_engine_stand_in_for_bridge()
import megatron.bridge.training.checkpointing as m
import megatron.bridge.training.setup as setup
from megatron.bridge.training.utils import checkpoint_utils
from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.runtime import bridge as f

def row():
    r = {r["id"]: r for r in mcore_ckpt_fixes.report()}["fsdp-dtensor-pp-guard"]
    return r["targets"].get("megatron.bridge.training.checkpointing", {"state": r["state"]})

out = {"auto": row(), "replaced": [m._load_checkpoint_from_path is f._load_checkpoint_from_path,
       setup._load_checkpoint_from_path is f._load_checkpoint_from_path, m.read_run_config is f.read_run_config,
       checkpoint_utils.read_run_config is f.read_run_config]}
mcore_ckpt_fixes.revert()
os.environ["MCORE_CKPT_FIX_FSDP_DTENSOR_PP_GUARD"] = "off"
mcore_ckpt_fixes.apply()
out["off"] = row()
out["off_modules"] = [m._load_checkpoint_from_path.__module__, setup._load_checkpoint_from_path.__module__,
                      m.read_run_config is checkpoint_utils.read_run_config]
print(json.dumps(out))
"""


def test_status_applied_and_flag_off():
    """After importing Bridge the target is applied (the probe ran Bridge's own fsdp_dtensor
    preprocessing on a stand-in model); the fix's flag off leaves Bridge's functions alone."""
    proc = run_py(_STATUS, {}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    auto, off = out["auto"], out["off"]
    assert auto["state"] == "applied" and auto["package"] == FRAMEWORK, auto
    assert "index within its pipeline stage" in auto["reason"], auto
    # Bridge's setup.py binding is rebound; read_run_config only in the checkpointing module.
    assert out["replaced"] == [True, True, True, False], out["replaced"]
    assert off["state"] == "disabled", off
    assert out["off_modules"] == [BRIDGE, BRIDGE, True], out["off_modules"]


def test_unguarded_bridge_loads_the_first_stages_layers(tmp_path):
    """Bridge 0.6.2 as released: the PP=2 load of a PP=1 fsdp_dtensor checkpoint returns without an
    error on both ranks, stage 1 holding the checkpoint's layer 0 as its first layer (global layer 1);
    stage 0 is right. The same layout loads exactly."""
    results = _world(tmp_path, patched=False)
    for r in results:
        assert r["fix_state"] == {BRIDGE: "disabled"}, r["fix_state"]
        assert r["refusal"] is None and r["phase"] == "layers" and r["error"] == WRONG_LAYERS, r["error"]
        assert [tuple(s) for s in r["seen"]] == [(0, True, True), (1, False, True)], r["seen"]


def test_guarded_bridge_refuses_on_every_rank_before_loading(tmp_path):
    """With the guard both ranks refuse the PP=2 load with the same one-line ValueError naming both
    layouts and the remedy, their weights untouched (nothing was loaded); the PP=1 load is exact."""
    results = _world(tmp_path, patched=True)
    for r in results:
        assert r["error"] is None, r.get("traceback") or r["error"]
        assert r["fix_state"] == {BRIDGE: "applied"}, r["fix_state"]
        assert r["refusal"] == REFUSAL, r["refusal"]
        assert r["untouched"] is True
        _exact(r)


def test_guard_leaves_torch_dist_alone(tmp_path):
    """The control: Bridge's torch_dist checkpoint names layers by their global number, so its PP=2
    load is right; with the guard on it loads as without (no refusal, stage 1 holds layer 1)."""
    for r in _world(tmp_path, patched=True, ckpt_format="torch_dist"):
        assert r["error"] is None, r.get("traceback") or r["error"]
        assert r["refusal"] is None
        assert [tuple(s) for s in r["seen"]] == [(0, True, True), (1, True, False)], r["seen"]
        _exact(r)


# -- the comparison itself: one spelling of a layout, no false refusal ---------------------------------


def _cfg(**fields):
    base = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None}
    return types.SimpleNamespace(**{**base, **fields})


def test_layout_spellings_and_what_is_left_alone():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.runtime.bridge import (
        _refuse_fsdp_dtensor_pipeline_change as refuse,
    )

    layout = PipelineParallelLayerLayout("Et|tL", 2)
    saved = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None}
    # the layout as the run's object, the checkpoint's string or list of the same rows: the same
    refuse(
        {"model": {**saved, "pipeline_model_parallel_layout": "Et|tL"}},
        _cfg(pipeline_model_parallel_layout=layout),
        "c",
    )
    listed = [["embedding", "decoder"], ["decoder", "loss"]]
    refuse(
        {"model": {**saved, "pipeline_model_parallel_layout": listed}}, _cfg(pipeline_model_parallel_layout=layout), "c"
    )
    with pytest.raises(
        ValueError, match=r"pipeline_model_parallel_layout=Ett\|L; this run has pipeline_model_parallel_layout=Et\|tL"
    ):
        refuse(
            {"model": {**saved, "pipeline_model_parallel_layout": "Ett|L"}},
            _cfg(pipeline_model_parallel_layout=layout),
            "c",
        )
    with pytest.raises(
        ValueError,
        match="virtual_pipeline_model_parallel_size=2; this run has virtual_pipeline_model_parallel_size=None",
    ):
        refuse({"model": {**saved, "virtual_pipeline_model_parallel_size": 2}}, _cfg(), "c")
    # nothing to compare with: no run config, no model section, a field either side lacks, MIMO
    for run_config in (None, {}, {"model": {}}, {"model": {"num_layers": 4}}):
        refuse(run_config, _cfg(), "c")
    refuse({"model": {"pipeline_model_parallel_size": 1, "megatron_mimo_parallelism_config": {}}}, _cfg(), "c")


# -- the source diff ---------------------------------------------------------------------------------

_SOURCE = """
import os, pickle
from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.checks.bridge import prepare
prepare()
import megatron.bridge
assert megatron.bridge.__path__[0] == os.environ["PATCHED_BRIDGE"], megatron.bridge.__path__
import megatron.bridge.training.checkpointing as m
from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.runtime.bridge import probe
verdict, reason = probe(m)
from mcore_ckpt_fixes.testing.launcher import run_world, values
RT = "mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.checks.bridge:pp1_to_pp2"
out = values(run_world(RT, 2, {"ckpt_dir": os.environ["CKPT"], "patched": False},
                       env={"MCORE_CKPT_FIXES": "off"}, timeout=240))
with open(os.environ["RESULT"], "wb") as f:
    pickle.dump({"probe": (verdict, reason), "world": out}, f)
"""


def test_source_patch(tmp_path, bridge):
    """The diff applied to the pristine Bridge source, the monkeypatch off: the probe says guarded,
    both ranks refuse the PP=2 load with the runtime's line, untouched, and the PP=1 load is exact."""
    bridge_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(bridge.__file__))))
    src = tmp_path / "src"
    shutil.copytree(
        os.path.join(bridge_root, "megatron", "bridge"),
        src / "megatron" / "bridge",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    proc = subprocess.run(["patch", "-p1", "--forward", "-i", PATCH], cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "ckpt").mkdir()
    env = {
        "PYTHONPATH": str(src),
        "PATCHED_BRIDGE": str(src / "megatron" / "bridge"),
        "CKPT": str(tmp_path / "ckpt"),
        "RESULT": str(tmp_path / "result.pkl"),
        "MCORE_CKPT_FIXES": "off",
    }
    proc = run_py(_SOURCE, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "result.pkl", "rb") as f:
        out = pickle.load(f)
    verdict, reason = out["probe"]
    assert verdict is False and "refuses a checkpoint of another pipeline layout" in reason, reason
    for r in out["world"]:
        assert r["error"] is None, r.get("traceback") or r["error"]
        assert r["fix_state"] == {BRIDGE: "disabled"}, r["fix_state"]
        assert r["refusal"] == REFUSAL and r["untouched"] is True, r["refusal"]
        _exact(r)


def test_patch_is_current():
    """The committed diff is what diff/bridge.py renders from the released file."""
    from mcore_ckpt_fixes.fixes.fsdp_dtensor_pp_guard.diff.bridge import PATH
    from mcore_ckpt_fixes.sourcediff import fix_edits, render

    import megatron.bridge.training.checkpointing as m

    src_root = m.__file__[: -len(PATH)]
    with open(PATCH, encoding="utf-8") as f:
        assert render(src_root, fix_edits("fsdp-dtensor-pp-guard", "megatron-bridge-0.6.2")) == f.read()
