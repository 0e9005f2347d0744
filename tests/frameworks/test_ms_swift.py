"""rng-under-ep in ms-swift 4.6.0 (``swift.megatron.utils.megatron_lm_utils``), driven through ms-swift's
own ``initialize_megatron`` / ``save_mcore_checkpoint`` / ``load_mcore_checkpoint``.

World 2, EP=2 (TP=PP=1), gloo on CPU, a small real GPTModel with one local expert per EP rank: see
mcore_ckpt_fixes/fixes/rng_under_ep/checks/ms_swift.py for what each world does and the
stand-ins its workers use (CPU generator for CUDA's, CPU buffers for the fully parallel load's
exchange, and an empty ``transformer_engine`` package around ``mcore_bridge``'s import only:
mcore-bridge 1.6.5 imports Transformer Engine unconditionally, and it cannot be installed on a CPU
host). ms-swift is imported in the worlds' ranks and in subprocesses only, never in this process:
its import patches torch's DCP reader and planner process-wide.

Environment: ``tools/envs.sh fw-ms-swift`` (tools/frameworks/ms-swift.txt). Where ms-swift is not
installed these tests skip, except with ``MCORE_CKPT_FIXES_FRAMEWORK=ms-swift`` (its own line), where
they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from importlib import metadata

import pytest

from conftest import run_py
from rng_worlds import RngWorlds

NAME = "ms-swift"
MODULE = "swift.megatron.utils.megatron_lm_utils"
SC = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.ms_swift"
COMPONENTS = {
    "python",
    "numpy",
    "torch_cpu",
    "cuda",
    "tracker:data-parallel-rng",
    "tracker:model-parallel-rng",
    "tracker:expert-parallel-rng",
}
OLD_LAYOUT = "stores the RNG state in the old 2-D (pp, tp) layout"
FSDP_OLD_LAYOUT = "it was written before rng-under-ep covered fsdp_dtensor"


def _installed():
    """ms-swift and mcore-bridge present (found without importing them: see the module docstring)."""
    try:
        metadata.version(NAME)
        return importlib.util.find_spec("mcore_bridge") is not None and importlib.util.find_spec("swift") is not None
    except (metadata.PackageNotFoundError, ImportError, ValueError):
        return False


@pytest.fixture(scope="module", autouse=True)
def ms_swift():
    if not _installed():
        if os.environ.get("MCORE_CKPT_FIXES_FRAMEWORK") == NAME:
            pytest.fail(f"{NAME} is this line's framework but is not installed (tools/envs.sh fw-{NAME})")
        pytest.skip(f"{NAME} not installed here; run tools/test.sh fw-{NAME}")
    import megatron.core.models.gpt  # noqa: F401  (warm: every world forks from this process)
    import megatron.core.dist_checkpointing  # noqa: F401


RNG = RngWorlds(SC, COMPONENTS, timeout=240)


# -- probe and status (subprocesses: ms-swift imported there, with the Transformer Engine stand-in) --

_STATUS = """
import json, mcore_ckpt_fixes
from mcore_ckpt_fixes.fixes.rng_under_ep.checks.ms_swift import import_swift
m = import_swift()
row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["rng-under-ep"]
from mcore_ckpt_fixes.fixes.rng_under_ep.runtime import ms_swift as f
bound = {"get_rng_state": m._get_rng_state is f.get_rng_state,
         "dist_checkpointing": m.dist_checkpointing is f.DIST_CHECKPOINTING,
         "select_rng_state": m.fsdp_checkpoint.select_rng_state is f.select_rng_state}
print(json.dumps({"row": row, "bound": bound}))
"""


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status(env=None):
    """Run _STATUS in a fresh interpreter with clean fix flags plus ``env``."""
    proc = run_py(_STATUS, env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_status_applied_after_importing_ms_swift():
    got = _status()
    target = got["row"]["targets"][MODULE]
    assert target["state"] == "applied" and target["package"] == NAME, got["row"]
    assert got["bound"] == {"get_rng_state": True, "dist_checkpointing": True, "select_rng_state": True}, got
    reason = got["row"]["reason"] + target.get("reason", "")
    assert "keys the torch_dist RNG state by (pp, tp) only" in json.dumps(got["row"]), got["row"]
    assert "rng_state/shard_0.0_1.1" in json.dumps(got["row"]), reason


def test_flag_off_disables_the_ms_swift_target():
    got = _status({"MCORE_CKPT_FIX_RNG_UNDER_EP": "off"})
    assert got["row"]["state"] == "disabled", got["row"]
    assert got["bound"] == {"get_rng_state": False, "dist_checkpointing": False, "select_rng_state": False}, got


# -- torch_dist: round trips through save_mcore_checkpoint / load_mcore_checkpoint ---------------------


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory):
    """The unfixed round trip; its checkpoint is the old 2-D layout, loaded again below."""
    d = tmp_path_factory.mktemp("swift-rng-old")
    return d, RNG.world("ep2_round_trip", False, d)


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    d = tmp_path_factory.mktemp("swift-rng-new")
    return d, RNG.ok(RNG.world("ep2_round_trip", True, d))


def test_unpatched_ep_rank1_restores_rank0(unpatched):
    _, (r0, r1) = unpatched
    saved = [r0["saved"], r1["saved"]]
    RNG.ranks_differ(saved)
    assert r0["layout"] == ([1, 1], [0, 0], 0) and r1["layout"] == ([1, 1], [0, 0], 1), (r0["layout"], r1["layout"])
    assert r0["fix_state"] == {MODULE: "disabled"}
    assert r0["error"] is None and set(r0["max_delta"].values()) == {0.0}, r0["max_delta"]
    assert r1["phase"] == "compare" and r1["error"].startswith("AssertionError: RNG states differ after load"), r1[
        "error"
    ]
    # EP rank 1 resumes on EP rank 0's states, the expert-parallel tracker stream included.
    assert RNG.delta(r1["loaded"]["tracker:expert-parallel-rng"], saved[0]["tracker:expert-parallel-rng"]) == 0.0
    assert RNG.same(r1["loaded"], saved[0]), {k: RNG.delta(r1["loaded"][k], saved[0][k]) for k in COMPONENTS}
    assert r0["model_max_delta"] == 0.0 and r1["model_max_delta"] == 0.0


def test_patched_round_trip_is_exact(patched):
    _, results = patched
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ([1, 1, 2], [0, 0, rank], 0), r["layout"]
        assert set(r["max_delta"]) == COMPONENTS and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert RNG.same(r["loaded"], r["saved"]) and r["model_max_delta"] == 0.0
        assert r["fix_state"] == {MODULE: "applied"} and r["warnings"] == []


def test_old_layout_loads_patched_with_warning(unpatched):
    """The checkpoint the unfixed ms-swift wrote: both ranks restore its one (pp, tp) copy (rank 0's
    own), and each is told so, naming the old layout."""
    d, results = unpatched
    saved = [r["saved"] for r in results]
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, d))):
        assert len(r["warnings"]) == 1, r["warnings"]
        (w,) = r["warnings"]
        assert w.startswith("MegatronPatchWarning: mcore_ckpt_fixes: rng-under-ep: ") and OLD_LAYOUT in w, w
        assert f"this rank (pp 0, tp 0, dp_cp {rank}) restores that copy" in w, w
        assert RNG.same(r["loaded"], saved[0]), rank


# -- fsdp_dtensor (--use_megatron_fsdp; the model is not wrapped: its CUDA buffers need a GPU) ------


def test_fsdp_dtensor_unpatched_and_patched(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    r0, r1 = RNG.world("ep2_round_trip", False, old, fsdp_dtensor=True)
    saved = [r0["saved"], r1["saved"]]
    RNG.ranks_differ(saved)
    assert r0["layout"] == ["(0, 0)"] and r1["layout"] == ["(0, 0)"]
    # One (pp, tp) entry, DCP keeps one copy of each leaf: both ranks restore that mix of the two
    # ranks' saved states, and neither gets all of its own back.
    for rank, r in enumerate((r0, r1)):
        assert r["phase"] == "compare" and r["error"].startswith("AssertionError: RNG states differ after load"), r[
            "error"
        ]
        assert r["model_max_delta"] == 0.0 and r["warnings"] == []
        for k in COMPONENTS:  # every component one of the two ranks' states, some the other rank's
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
        assert any(RNG.delta(r["loaded"][k], saved[rank][k]) != 0.0 for k in COMPONENTS), rank
    assert RNG.same(r0["loaded"], r1["loaded"])  # one mix, on both ranks
    for rank, r in enumerate(RNG.ok(RNG.world("ep2_round_trip", True, new, fsdp_dtensor=True))):
        assert r["layout"] == ["(0, 0)", f"(0, 0, {rank})"], r["layout"]
        assert set(r["max_delta"].values()) == {0.0} and RNG.same(r["loaded"], r["saved"]) and r["warnings"] == []
    # The old checkpoint, loaded with the fix: the shared copy (each component one of the saved
    # states, restored from the checkpoint, not the fresh states kept), with the old-layout warning.
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, old, fsdp_dtensor=True))):
        assert len(r["warnings"]) == 1 and FSDP_OLD_LAYOUT in r["warnings"][0], r["warnings"]
        assert f"(pp 0, tp 0, dp_cp {rank})" in r["warnings"][0], r["warnings"]
        for k in COMPONENTS:
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
        assert not RNG.same(r["loaded"], r["before"]), rank


# -- the source patch (patches/rng-under-ep/ms-swift-4.6.0.patch), monkeypatch off -----------------

_SOURCE_RUN = r"""
import json, os, pickle, sys
from mcore_ckpt_fixes.fixes.rng_under_ep.checks.ms_swift import import_swift
import megatron.core.models.gpt
from mcore_ckpt_fixes.testing.launcher import run_world, values
SC = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.ms_swift"
off = {"MCORE_CKPT_FIXES": "off"}
new = values(run_world(SC + ":ep2_round_trip", 2, {"ckpt_dir": os.environ["NEW_DIR"], "patched": False}, env=off, timeout=240))
old = values(run_world(SC + ":load_only", 2, {"ckpt_dir": os.environ["OLD_DIR"], "patched": False}, env=off, timeout=240))
m = import_swift()  # after the worlds: this parent stays unpatched by ms-swift's import meanwhile
assert m.__file__.startswith(os.environ["PATCHED"]), m.__file__
from mcore_ckpt_fixes.fixes.rng_under_ep.runtime.ms_swift import probe
verdict, why = probe(m)
with open(os.environ["RESULT"], "wb") as f:
    pickle.dump({"new": new, "old": old, "probe": (verdict, why)}, f)
"""


def test_source_patch_round_trips_with_the_monkeypatch_off(unpatched, tmp_path):
    """patches/rng-under-ep/ms-swift-4.6.0.patch applied to ms-swift's released source: the probe
    says fixed, the round trip is exact with the monkeypatch off, and the unfixed release's
    checkpoint loads its one copy with a plain warning naming the old layout."""
    import pickle
    import shutil

    old_dir, old_results = unpatched
    src = os.path.dirname(importlib.util.find_spec("swift").origin)
    shutil.copytree(src, tmp_path / "swift", ignore=shutil.ignore_patterns("__pycache__"))
    patch_file = os.path.join(ROOT, "patches", "rng-under-ep", "ms-swift-4.6.0.patch")
    proc = subprocess.run(["patch", "-p1", "--forward", "-i", patch_file], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(
        PYTHONPATH=str(tmp_path),  # the patched ms-swift shadows the installed one
        PATCHED=str(tmp_path / "swift"),
        NEW_DIR=str(tmp_path / "new"),
        OLD_DIR=str(old_dir),
        RESULT=str(tmp_path / "result.pkl"),
        MCORE_CKPT_FIXES="off",
    )
    proc = run_py(_SOURCE_RUN, env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "result.pkl", "rb") as f:
        got = pickle.load(f)
    assert got["probe"][0] is False, got["probe"]
    for rank, r in enumerate(RNG.ok(got["new"])):
        assert r["layout"] == ([1, 1, 2], [0, 0, rank], 0) and r["fix_state"] == {MODULE: "disabled"}
        assert set(r["max_delta"].values()) == {0.0} and RNG.same(r["loaded"], r["saved"]), r["max_delta"]
    saved_old = [r["saved"] for r in old_results]
    for rank, r in enumerate(RNG.ok(got["old"])):
        assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("UserWarning: "), r["warnings"]
        assert OLD_LAYOUT in r["warnings"][0] and f"(pp 0, tp 0, dp_cp {rank})" in r["warnings"][0]
        assert RNG.same(r["loaded"], saved_old[0]), rank
