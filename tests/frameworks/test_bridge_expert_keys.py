"""expert-keys through Megatron-Bridge's own fsdp_dtensor preprocessing.

Megatron-Bridge 0.6.2 binds Megatron-Core's ``preprocess_state_dict_for_uneven_dtensor`` by name when
``megatron.bridge.training.checkpointing`` is imported and calls that binding from its own
``preprocess_fsdp_dtensor_state_dict``, which its fsdp_dtensor save and load both run. The fix
replaces that binding too (single grouped expert tensors made EP-global), so ``import
mcore_ckpt_fixes`` alone covers Bridge users.

Real: Megatron-Bridge (installed from tools/frameworks/megatron-bridge.txt), its
``preprocess_fsdp_dtensor_state_dict``, Megatron-Core's parallel_state / Megatron-FSDP meshes and
``make_fsdp_dtensor``, torch DCP save/load, 2 forked ranks on gloo with EP=2. Stand-ins: the model
(see mcore_ckpt_fixes/fixes/expert_keys/checks/core.py: Transformer Engine's grouped MLP cannot be
installed on a CPU host, so a module tree with its parameter names) and, for importing Bridge at all,
the Transformer Engine stand-in of mcore_ckpt_fixes/testing/_standins.py (Bridge's import chain
reaches ``transformer_engine``; nothing of it runs in these round trips).
Single grouped expert tensors exist from Megatron-Core 0.18, but Megatron-Bridge 0.6.2 imports only
on 0.19 (``megatron.training.models.gpt``; measured: ModuleNotFoundError on 0.18.2), and Bridge
0.5.x, its 0.18 pairing, imports Transformer Engine in more modules than the stand-in covers (its
``peft.lora`` too): run in the megatron-bridge line, on 0.19.2.
"""

from __future__ import annotations

import pytest

from conftest import run_py
from framework_import import import_framework
from mcore_ckpt_fixes.fixes.expert_keys import BRIDGE, FIX, MODULE
from mcore_ckpt_fixes.testing.launcher import run_world, values
from mcore_ckpt_fixes.testing.registry import for_fix

RT = "mcore_ckpt_fixes.fixes.expert_keys.checks.bridge:bridge_ep2_grouped"
SCENARIOS = {s.name: s for s in for_fix(FIX.id)}
EXP = "decoder.layers.0.mlp.experts."
GROUPED_PARAMS = {
    "grouped": ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"),
    "grouped_bias": ("linear_fc1.bias", "linear_fc2.bias"),
}
GLOBAL_SHAPES = {
    "linear_fc1.weight": [4, 6, 4],
    "linear_fc1.bias": [4, 6],
    "linear_fc2.weight": [4, 4, 6],
    "linear_fc2.bias": [4, 4],
}


@pytest.fixture(scope="module", autouse=True)
def bridge():
    """Bridge imported in the warm parent (the forked ranks inherit it), after the fix's hooks."""
    from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    module = import_framework("megatron-bridge", BRIDGE)
    from mcore_ckpt_fixes.fixes.expert_keys.checks.core import prepare

    prepare()
    why = SCENARIOS["ep2_grouped"].absent()
    if why is not None:
        pytest.skip(f"single grouped expert tensors do not exist in this Megatron-Core: {why}")
    return module


def _run(variant, patched, tmp_path):
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    kwargs = {"ckpt_dir": str(tmp_path), "patched": patched, "variant": variant}
    return values(run_world(RT, 2, kwargs, env=env, timeout=180))


def test_bridge_binding_is_a_target_in_status():
    import mcore_ckpt_fixes

    row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["expert-keys"]
    assert row["targets"][BRIDGE]["state"] == "applied", row["targets"]


@pytest.mark.parametrize("variant", ["grouped", "grouped_bias"])
def test_unpatched_bridge_preprocessing(variant, tmp_path, mcore_version):
    """Unpatched: a grouped weight stops Bridge's preprocessing with upstream's assertion on every
    rank; a grouped bias beside indexed weights saves, and EP rank 0 loads EP rank 1's biases."""
    results = _run(variant, False, tmp_path)
    if variant == "grouped":
        # (the optimizer's parameter naming asserts while the state is built, before Bridge's
        # preprocessing is reached, exactly as on Megatron-LM's own path)
        bug = SCENARIOS["ep2_grouped"].bug_for(mcore_version)
        for rank, r in enumerate(results):
            assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r["phase"], r["error"])
        return
    coords = results[0]["coords"]
    biases = sorted(
        [f"model/{EXP}{b}" for b in GROUPED_PARAMS[variant]]
        + [f"optimizer/{EXP}{b}/{s}" for b in GROUPED_PARAMS[variant] for s in ("exp_avg", "exp_avg_sq")]
    )
    for rank, r in enumerate(results):
        assert r["via"] == BRIDGE and r["fix_state"] == {MODULE: "disabled", BRIDGE: "disabled"}, (rank, r["fix_state"])
        if coords[rank][0] == 0:
            assert sorted(k for k, d in r["max_delta"].items() if d != 0.0) == biases, (rank, r["max_delta"])
            assert r["loaded_from"] == {k: [1] for k in biases}, (rank, r["loaded_from"])
        else:
            assert r["error"] is None and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


@pytest.mark.parametrize("variant", ["grouped", "grouped_bias"])
def test_patched_bridge_preprocessing_round_trips_exactly(variant, tmp_path):
    """Patched (the import alone, no call by hand): one global tensor of all 4 experts per grouped
    key, each EP rank writes and loads its own rows; every tensor exact on every rank."""
    results = _run(variant, True, tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["via"] == BRIDGE and r["fix_state"] == {MODULE: "applied", BRIDGE: "applied"}, (rank, r["fix_state"])
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert {k: r["stored_shapes"][f"{EXP}{k}"] for k in GROUPED_PARAMS[variant]} == {
            k: GLOBAL_SHAPES[k] for k in GROUPED_PARAMS[variant]
        }, r["stored_shapes"]


_SOURCE_RUN = r"""
import json, os, sys, tempfile
from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge
install_transformer_engine_stand_in_for_bridge()
import megatron.core, megatron.bridge
assert megatron.core.__path__[0].startswith(os.environ["PATCHED_ROOT"]), megatron.core.__path__
assert megatron.bridge.__path__[0].startswith(os.environ["PATCHED_ROOT"]), megatron.bridge.__path__
import megatron.bridge.training.checkpointing
from mcore_ckpt_fixes.fixes.expert_keys.checks.core import prepare
prepare()
from mcore_ckpt_fixes.testing.launcher import run_world, values
res = values(run_world(os.environ["RT"], 2, {"ckpt_dir": tempfile.mkdtemp(), "patched": False, "variant": "grouped"},
                       env={"MCORE_CKPT_FIXES": "off"}, timeout=240))
print("RESULT " + json.dumps([{"error": r["error"], "max_delta": r["max_delta"], "via": r["via"]} for r in res]))
"""


def test_source_diffs_fix_bridge_without_the_import(bridge, tmp_path, mcore_version):
    """patches/expert-keys/<release>.patch on Megatron-Core plus megatron-bridge-0.6.2.patch on
    Bridge, monkeypatch off: Bridge's preprocessing takes the patched one and round-trips exactly."""
    import json
    import os
    import shutil
    import subprocess

    from mcore_ckpt_fixes.engine.version import detect

    ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    root = tmp_path / "src"
    shutil.copytree(detect().path, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        os.path.dirname(bridge.__file__).rsplit(os.sep, 1)[0],
        root / "megatron" / "bridge",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for diff in (f"{mcore_version}.patch", "megatron-bridge-0.6.2.patch"):
        proc = subprocess.run(
            ["patch", "-p1", "--forward", "-i", os.path.join(ROOT, "patches", "expert-keys", diff)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0 and "fuzz" not in proc.stdout.lower(), proc.stdout + proc.stderr
    # The patched Megatron-Core and Bridge shadow the installed ones.
    proc = run_py(_SOURCE_RUN, {"PYTHONPATH": str(root), "PATCHED_ROOT": str(root), "RT": RT}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert r["via"] == BRIDGE and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
