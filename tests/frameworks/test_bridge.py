"""rng-under-ep in Megatron-Bridge 0.6.2's own checkpointing.

Real: Megatron-Bridge (installed from tools/frameworks/megatron-bridge.txt) and its own
``get_rng_state``, ``save_checkpoint``, ``load_checkpoint`` / ``load_fsdp_dtensor_checkpoint`` with a
real Bridge ``ConfigContainer`` / ``GlobalState``, Bridge's own seeding, a small real Megatron-Core
``GPTModel`` with one local expert per EP rank, DCP / dist_checkpointing, 2 forked ranks on gloo,
EP=2 (TP=PP=1, DP=2). What each world does: mcore_ckpt_fixes/fixes/rng_under_ep/checks/bridge.py.

The bug is Bridge's ``fsdp_dtensor`` RNG entry, keyed ``"(pp, tp)"`` only: DCP keeps one copy of
each of its leaves, written by different ranks, so both EP ranks restore a mix of the two ranks'
states. Bridge's ``torch_dist`` RNG state is per rank under EP already (asserted unpatched below: the
fix is scoped to fsdp_dtensor).

Stand-ins (test processes only, never ``import mcore_ckpt_fixes``):

* Transformer Engine, for importing Bridge at all: ``megatron.bridge.peft.lora_layers`` imports
  ``transformer_engine.pytorch`` without a fallback and TE cannot be installed without CUDA;
  mcore_ckpt_fixes/testing/_standins.py (``install_transformer_engine_stand_in_for_bridge``) shows that
  module, and only it, a stand-in while it is imported. Nothing of TE runs in these round trips.
* the CUDA RNG: one CPU ``torch.Generator`` plays the CUDA default generator
  (``round_trips.CudaRngStandIn``), so the CUDA state and every tracker stream are distinct per rank.
* Megatron-FSDP: the model is not wrapped (its CUDA buffers cannot be built here); Bridge's
  fsdp_dtensor save and load run on the plain model's state dict. The RNG entry does not depend on
  the wrapper.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess

import pytest

from conftest import run_py
from framework_import import import_framework
from mcore_ckpt_fixes.fixes.rng_under_ep import FIX
from rng_worlds import RngWorlds

FRAMEWORK = "megatron-bridge"
BRIDGE = "megatron.bridge.training.checkpointing"
RT = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.bridge"
COMPONENTS = {
    "python",
    "numpy",
    "torch_cpu",
    "cuda",
    "tracker:data-parallel-rng",
    "tracker:model-parallel-rng",
    "tracker:expert-parallel-rng",
}
EXPERT = "tracker:expert-parallel-rng"
OLD_LAYOUT = "the old layout: one shared copy per (pp, tp)"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code, **env):
    """Run ``code`` in a fresh interpreter of this environment, fix flags cleared, ``env`` added."""
    proc = run_py(code, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.fixture(scope="module", autouse=True)
def bridge():
    """Bridge imported in the warm parent (the forked ranks inherit it), after the fix's hooks."""
    from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    module = import_framework(FRAMEWORK, BRIDGE)
    from mcore_ckpt_fixes.fixes.rng_under_ep.checks.bridge import prepare

    prepare()
    return module


RNG = RngWorlds(RT, COMPONENTS, timeout=180)


def _is_the_shared_copy(results, saved):
    """Both ranks restored the same states, each component one of the two ranks' saved ones (DCP's
    one copy of each leaf), and at least one rank got a component of the other rank's."""
    for k in COMPONENTS:
        loaded = [r["loaded"][k] for r in results]
        assert RNG.delta(loaded[0], loaded[1]) == 0.0, k
        assert RNG.delta(loaded[0], saved[0][k]) == 0.0 or RNG.delta(loaded[0], saved[1][k]) == 0.0, k
    assert any(not RNG.same(r["loaded"], saved[rank]) for rank, r in enumerate(results))


# -- status, probe, flag ------------------------------------------------------------------------------

_STATUS = """
import json, os
import mcore_ckpt_fixes
from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge
install_transformer_engine_stand_in_for_bridge()
import megatron.bridge.training.checkpointing as m
from mcore_ckpt_fixes.fixes.rng_under_ep.runtime import bridge as f

def row():
    r = {r["id"]: r for r in mcore_ckpt_fixes.report()}["rng-under-ep"]
    return r["targets"].get("megatron.bridge.training.checkpointing", {"state": r["state"]})

out = {"auto": row(), "auto_replaced": [m.get_rng_state is f.get_rng_state,
       m.load_fsdp_dtensor_checkpoint is f.load_fsdp_dtensor_checkpoint]}
mcore_ckpt_fixes.revert()
os.environ["MCORE_CKPT_FIX_RNG_UNDER_EP"] = "off"
mcore_ckpt_fixes.apply()
out["off"] = row()
out["off_modules"] = [m.get_rng_state.__module__, m.load_fsdp_dtensor_checkpoint.__module__]
print(json.dumps(out))
"""


def test_status_applied_and_flag_off():
    """After importing Bridge the target is applied (the probe ran Bridge's own get_rng_state on
    stand-ins); MCORE_CKPT_FIX_RNG_UNDER_EP=off disables it and leaves Bridge's functions alone."""
    out = json.loads(_python(_STATUS).strip().splitlines()[-1])
    auto, off = out["auto"], out["off"]
    assert auto["state"] == "applied" and auto["package"] == FRAMEWORK, auto
    assert "keys the fsdp_dtensor RNG entry by (pp, tp) only" in auto["reason"], auto
    assert "both write ['(0, 0)']" in auto["reason"], auto
    assert out["auto_replaced"] == [True, True]
    assert off["state"] == "disabled", off
    assert out["off_modules"] == [BRIDGE, BRIDGE]


# -- torch_dist: per rank under EP already (the target is fsdp_dtensor only) ---------------------------


def test_torch_dist_is_per_rank_unpatched(tmp_path):
    """Bridge's own torch_dist RNG ShardedObject is (pp, tp, dp_cp) with replica_id=0 under EP: with
    the fix off every EP rank restores exactly its own states, EP rank 1 its expert stream included."""
    results = RNG.ok(RNG.world("ep2_round_trip", False, tmp_path, ckpt_format="torch_dist"))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ([1, 1, 2], [0, 0, rank], 0), r["layout"]
        assert r["fix_state"] == {BRIDGE: "disabled"}, r["fix_state"]
        assert set(r["max_delta"].values()) == {0.0} and RNG.same(r["loaded"], r["saved"]), r["max_delta"]
        assert r["model_max_delta"] == 0.0 and r["warnings"] == []


# -- fsdp_dtensor: the bug and the fix -------------------------------------------------------------


@pytest.fixture(scope="module")
def unpatched_fsdp(tmp_path_factory):
    """Bridge's fsdp_dtensor round trip with the fix off; its checkpoint (the old layout) stays."""
    d = tmp_path_factory.mktemp("bridge-rng-fsdp-old")
    return d, RNG.world("ep2_round_trip", False, d)


@pytest.fixture(scope="module")
def patched_fsdp(tmp_path_factory):
    """The same with the fix on; its checkpoint (with every rank's own entry) stays."""
    d = tmp_path_factory.mktemp("bridge-rng-fsdp-new")
    return d, RNG.world("ep2_round_trip", True, d)


def test_fsdp_dtensor_unpatched_ranks_restore_a_mix(unpatched_fsdp):
    """One "(pp, tp)" entry for both EP ranks: both restore the same states, leaf by leaf one of the
    two ranks' (not even one rank's whole state), so an EP rank resumes on the other's streams."""
    _, results = unpatched_fsdp
    saved = [r["saved"] for r in results]
    RNG.ranks_differ(saved)
    for rank, r in enumerate(results):
        assert r["layout"] == ["(0, 0)"], r["layout"]
        assert r["fix_state"] == {BRIDGE: "disabled"}, r["fix_state"]
        assert r["phase"] == "compare" and r["error"].startswith("AssertionError: RNG states differ after load"), r[
            "error"
        ]
        assert r["model_max_delta"] == 0.0 and r["warnings"] == []
    _is_the_shared_copy(results, saved)
    # The expert-parallel tracker stream: one EP rank restores the other EP rank's.
    experts = [r["loaded"][EXPERT] for r in results]
    owner = 0 if RNG.delta(experts[0], saved[0][EXPERT]) == 0.0 else 1
    assert RNG.delta(experts[1 - owner], saved[owner][EXPERT]) == 0.0
    assert RNG.delta(experts[1 - owner], saved[1 - owner][EXPERT]) != 0.0


def test_fsdp_dtensor_patched_round_trip_is_exact(patched_fsdp):
    _, results = patched_fsdp
    results = RNG.ok(results)
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ["(0, 0)", f"(0, 0, {rank})"], r["layout"]  # the release's entry + this rank's own
        assert r["fix_state"] == {BRIDGE: "applied"}, r["fix_state"]
        assert set(r["max_delta"]) == COMPONENTS and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert RNG.same(r["loaded"], r["saved"]) and r["model_max_delta"] == 0.0 and r["warnings"] == []


@pytest.mark.parametrize("strict", [False, True], ids=["partial-load", "strict-load"])
def test_old_layout_loads_patched_with_warning(unpatched_fsdp, strict):
    """What unfixed Bridge wrote: the fixed load restores the shared copy (as unfixed Bridge does)
    and says so on every rank, naming the old layout; also with strict_fsdp_dtensor_load, where DCP
    would refuse the per-rank entry the checkpoint lacks had the fix asked for it."""
    d, unpatched = unpatched_fsdp
    saved = [r["saved"] for r in unpatched]
    results = RNG.ok(RNG.world("load_only", True, d, strict=strict))
    for rank, r in enumerate(results):
        assert len(r["warnings"]) == 1, r["warnings"]
        (w,) = r["warnings"]
        assert w.startswith(f"MegatronPatchWarning: mcore_ckpt_fixes: {FIX.id}: ") and OLD_LAYOUT in w, w
        assert f"(pp 0, tp 0, dp_cp {rank})" in w, w
        assert RNG.same(r["loaded"], unpatched[rank]["loaded"]), rank  # what the unfixed load restored
    _is_the_shared_copy(results, saved)


def test_unfixed_bridge_reads_a_fixed_checkpoint(patched_fsdp):
    """The release's "(pp, tp)" entry is kept: unfixed Bridge loads a fixed checkpoint as its own
    (the shared copy, as always), never failing."""
    d, patched = patched_fsdp
    results = RNG.ok(RNG.world("load_only", False, d))
    for r in results:
        assert r["fix_state"] == {BRIDGE: "disabled"} and r["warnings"] == []
    _is_the_shared_copy(results, [r["saved"] for r in patched])


# -- the source diff (patches/rng-under-ep/megatron-bridge-0.6.2.patch) ------------------------------

_SOURCE = r"""
import json, os, pickle, sys
from mcore_ckpt_fixes.fixes.rng_under_ep.checks.bridge import prepare
prepare()
import megatron.bridge
assert megatron.bridge.__path__[0] == os.environ["PATCHED_BRIDGE"], megatron.bridge.__path__
import megatron.bridge.training.checkpointing as m
from mcore_ckpt_fixes.fixes.rng_under_ep.runtime.bridge import probe
verdict, reason = probe(m)
from mcore_ckpt_fixes.testing.launcher import run_world, values
RT = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.bridge"
off = {"MCORE_CKPT_FIXES": "off"}
round_trip = values(run_world(RT + ":ep2_round_trip", 2, {"ckpt_dir": os.environ["NEW_DIR"], "patched": False},
                              env=off, timeout=180))
old = values(run_world(RT + ":load_only", 2, {"ckpt_dir": os.environ["OLD_DIR"], "patched": False},
                       env=off, timeout=180))
with open(os.environ["RESULT"], "wb") as f:
    pickle.dump({"probe": (verdict, reason), "round_trip": round_trip, "old": old}, f)
"""


def test_source_patch(unpatched_fsdp, tmp_path, bridge):
    """The diff applied to the pristine Bridge source, the monkeypatch off: the probe says fixed, the
    fsdp_dtensor round trip is exact on every rank, and an old-layout checkpoint loads the shared
    copy with a warning naming the old layout."""
    old_dir, unpatched = unpatched_fsdp
    bridge_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(bridge.__file__))))
    src = tmp_path / "src"
    shutil.copytree(
        os.path.join(bridge_root, "megatron", "bridge"),
        src / "megatron" / "bridge",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    patch_file = os.path.join(ROOT, "patches", FIX.id, "megatron-bridge-0.6.2.patch")
    proc = subprocess.run(["patch", "-p1", "--forward", "-i", patch_file], cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "new").mkdir()
    _python(
        _SOURCE,
        PYTHONPATH=str(src),
        PATCHED_BRIDGE=str(src / "megatron" / "bridge"),
        NEW_DIR=str(tmp_path / "new"),
        OLD_DIR=str(old_dir),
        RESULT=str(tmp_path / "result.pkl"),
        MCORE_CKPT_FIXES="off",
    )
    with open(tmp_path / "result.pkl", "rb") as f:
        out = pickle.load(f)
    verdict, reason = out["probe"]
    assert verdict is False, reason
    for rank, r in enumerate(RNG.ok(out["round_trip"])):
        assert r["fix_state"] == {BRIDGE: "disabled"}, r["fix_state"]
        assert r["layout"] == ["(0, 0)", f"(0, 0, {rank})"], r["layout"]
        assert set(r["max_delta"].values()) == {0.0} and RNG.same(r["loaded"], r["saved"]), r["max_delta"]
    for rank, r in enumerate(RNG.ok(out["old"])):
        assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("UserWarning: "), r["warnings"]
        assert OLD_LAYOUT in r["warnings"][0] and f"(pp 0, tp 0, dp_cp {rank})" in r["warnings"][0], r["warnings"]
        assert RNG.same(r["loaded"], unpatched[rank]["loaded"]), rank


def test_patch_is_current():
    """The committed diff is what bridge_upstream.source_edits renders from the released file."""
    from mcore_ckpt_fixes.fixes.rng_under_ep.diff.bridge import PATH
    from mcore_ckpt_fixes.sourcediff import fix_edits, render

    import megatron.bridge.training.checkpointing as m

    src_root = m.__file__[: -len(PATH)]
    with open(os.path.join(ROOT, "patches", FIX.id, "megatron-bridge-0.6.2.patch"), encoding="utf-8") as f:
        assert render(src_root, fix_edits("rng-under-ep", "megatron-bridge-0.6.2")) == f.read()
