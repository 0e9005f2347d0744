"""rng-under-ep in verl 0.9.1 (``verl.utils.checkpoint.megatron_checkpoint_manager``), driven through
verl's own ``MegatronCheckpointManager``.

verl keeps its own copy of the bug (``MegatronCheckpointManager.get_rng_state``,
verl/utils/checkpoint/megatron_checkpoint_manager.py:268-302): torch_dist ``ShardedObject("rng_state",
..., (pp, tp), (pp_rank, tp_rank), replica_id=dp_cp_rank)`` into ``extra/dist_ckpt``, and the
Megatron-FSDP entry ``{"(pp, tp)": [state]}``.

Worlds: gloo on CPU, TP=PP=1, EP=2; 2 ranks (DP=2) and, for torch_dist, 4 ranks (EP=2 x DP=2 over a
data-parallel group of 4). Each rank builds a real ``MegatronCheckpointManager`` with
``save_contents = load_contents = ["extra"]`` and calls verl's own ``save_checkpoint`` /
``load_checkpoint``: ``get_rng_state`` -> ``save_dist_checkpointing`` into ``extra/dist_ckpt`` ->
``load_dist_checkpointing`` -> ``load_rng_states``. Stand-ins in the worlds' ranks only, never in
``import mcore_ckpt_fixes`` (see mcore_ckpt_fixes/fixes/rng_under_ep/checks/verl.py): one CPU
generator plays CUDA's (Megatron's RNG tracker needs one); a config / transformer-config namespace for
what the constructor and rank 0's JSON dump read; for Megatron-FSDP, a stand-in
``megatron.bridge.training.checkpointing`` doing Megatron-Bridge 0.6.2's DCP save / partial-load
(Bridge's model preprocessing needs a model wrapped in Megatron-FSDP, whose CUDA buffers a CPU host
cannot build), an empty model ``state_dict_for_save_checkpoint`` and optimizer ``sharded_state_dict``.
What is not run here: a real Megatron-FSDP model and Megatron-Bridge's own loader (with this fix's
Megatron-Bridge target applied, the verl fix lets Bridge's loader hand back the own entry: the
``load_rng_states`` wrapper accepts that without a warning), async saves, and the accelerator's own
generator (verl saves it only where a device is available).

Compared per rank: Python ``random``, NumPy, torch CPU and the three tracker streams
(``data-parallel-rng``, ``model-parallel-rng``, ``expert-parallel-rng``).

Environment: ``tools/envs.sh fw-verl`` (tools/frameworks/verl.txt). Where verl does not import
these tests skip, except with ``MCORE_CKPT_FIXES_FRAMEWORK=verl`` (its own line), where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from conftest import run_cli, run_py
from framework_import import import_framework
from rng_worlds import RngWorlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = "verl"
MODULE = "verl.utils.checkpoint.megatron_checkpoint_manager"
SC = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.verl"
COMPONENTS = {
    "python",
    "numpy",
    "torch_cpu",
    "tracker:data-parallel-rng",
    "tracker:model-parallel-rng",
    "tracker:expert-parallel-rng",
}
OLD_LAYOUT = "stores the RNG state in the old 2-D (pp, tp) layout"
FSDP_OLD_LAYOUT = "it was written before rng-under-ep covered fsdp_dtensor"


@pytest.fixture(scope="module", autouse=True)
def verl():
    """verl imported (or the module skipped / failed) and the parent warm: every world forks from it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_framework(NAME, MODULE)
    from mcore_ckpt_fixes.fixes.rng_under_ep.checks.verl import prepare

    prepare()


RNG = RngWorlds(SC, COMPONENTS, timeout=240)


# -- status and probe -------------------------------------------------------------------------------


def _row(code, extra):
    """Run ``code`` in a fresh interpreter; its ``ROW {json}`` line."""
    proc = run_py(code, extra, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROW "))[4:])


def test_status_applied_and_flag_off():
    """``python -m mcore_ckpt_fixes status`` (verl imported first): the verl target applied, with the
    probe's finding; MCORE_CKPT_FIX_RNG_UNDER_EP=off disables it and leaves verl's class alone."""
    code = """
        import json, warnings
        warnings.simplefilter("ignore")
        import verl.utils.checkpoint.megatron_checkpoint_manager as m
        import mcore_ckpt_fixes
        row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["rng-under-ep"]
        print("ROW " + json.dumps({"state": row["state"], "target": row["targets"].get(m.__name__),
                                   "method": m.MegatronCheckpointManager.get_rng_state.__module__,
                                   "load": m.load_dist_checkpointing.__module__}))
    """
    on = _row(code, {})
    assert on["target"]["state"] == "applied", on
    assert "keys the torch_dist RNG state by (pp, tp) only" in on["target"]["reason"], on
    assert "both address rng_state/shard_0.0_1.1 and rank 1 is a replica (replica_id=1)" in on["target"]["reason"], on
    assert on["method"] == on["load"] == "mcore_ckpt_fixes.fixes.rng_under_ep.runtime.verl", on
    off = _row(code, {"MCORE_CKPT_FIX_RNG_UNDER_EP": "off"})
    assert off["state"] == "disabled" and off["target"] is None, off
    assert off["method"] == MODULE and off["load"] == "verl.utils.megatron.dist_checkpointing", off

    proc = run_cli(["status", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = {r["id"]: r for r in json.loads(proc.stdout)}["rng-under-ep"]
    assert row["targets"][MODULE]["state"] == "applied", row["targets"]


# -- torch_dist (extra/dist_ckpt) -------------------------------------------------------------------


def test_unpatched_ep_rank1_restores_rank0(tmp_path):
    r0, r1 = RNG.world("round_trip", False, tmp_path)
    saved = [r0["saved"], r1["saved"]]
    RNG.ranks_differ(saved)
    assert r0["layout"] == ([1, 1], [0, 0], 0) and r1["layout"] == ([1, 1], [0, 0], 1), (r0["layout"], r1["layout"])
    assert r0["error"] is None and set(r0["max_delta"].values()) == {0.0}, r0["max_delta"]
    assert r1["phase"] == "compare" and r1["error"].startswith("AssertionError: RNG states differ after load"), r1[
        "error"
    ]
    # EP rank 1 resumes on EP rank 0's states, the expert-parallel tracker stream included.
    assert RNG.same(r1["loaded"], saved[0])
    assert RNG.delta(r1["loaded"]["tracker:expert-parallel-rng"], saved[1]["tracker:expert-parallel-rng"]) != 0.0
    assert r0["warnings"] == [] and r1["warnings"] == []


def test_patched_round_trip_is_exact(tmp_path):
    results = RNG.ok(RNG.world("round_trip", True, tmp_path))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ([1, 1, 2], [0, 0, rank], 0), r["layout"]
        assert set(r["max_delta"]) == COMPONENTS and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert not RNG.same(r["before"], r["saved"]) and RNG.same(r["loaded"], r["saved"])
        assert r["fix_state"] == {MODULE: "applied"} and r["warnings"] == []


def test_patched_ep2_dp4_four_ranks(tmp_path):
    """EP=2 x DP=2 on 4 ranks (data-parallel group of 4, two EP groups): every rank its own state."""
    results = RNG.ok(RNG.world("round_trip", True, tmp_path, nproc=4))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ([1, 1, 4], [0, 0, rank], 0), r["layout"]
        assert set(r["max_delta"].values()) == {0.0} and RNG.same(r["loaded"], r["saved"]), (rank, r["max_delta"])


@pytest.fixture(scope="module")
def old_ckpt(tmp_path_factory):
    """A checkpoint in verl's unfixed 2-D layout (fix off)."""
    d = tmp_path_factory.mktemp("verl-rng-old")
    return d, [r["saved"] for r in RNG.ok(RNG.world("save_only", False, d))]


def test_old_layout_loads_patched_with_warning(old_ckpt):
    d, saved = old_ckpt
    RNG.ranks_differ(saved)
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, d))):
        assert len(r["warnings"]) == 1, r["warnings"]
        (w,) = r["warnings"]
        assert w.startswith("MegatronPatchWarning: mcore_ckpt_fixes: rng-under-ep: ") and OLD_LAYOUT in w, w
        assert f"this rank (pp 0, tp 0, dp_cp {rank}) restores that copy" in w and "extra/dist_ckpt" in w, w
        assert RNG.same(r["loaded"], saved[0]), rank  # the one copy there is


# -- Megatron-FSDP (use_megatron_fsdp) --------------------------------------------------------------


def test_fsdp_unpatched_ranks_restore_a_mix(tmp_path):
    r0, r1 = RNG.world("round_trip", False, tmp_path, use_megatron_fsdp=True)
    saved = [r0["saved"], r1["saved"]]
    RNG.ranks_differ(saved)
    assert r0["layout"] == r1["layout"] == ["(0, 0)"]
    for rank, r in enumerate((r0, r1)):
        assert r["phase"] == "compare" and r["error"].startswith("AssertionError: RNG states differ after load"), r[
            "error"
        ]
        for k in COMPONENTS:  # every component one of the two ranks' states, some the other rank's
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
        assert any(RNG.delta(r["loaded"][k], saved[rank][k]) != 0.0 for k in COMPONENTS), rank


def test_fsdp_patched_round_trip_is_exact(tmp_path):
    results = RNG.ok(RNG.world("round_trip", True, tmp_path, use_megatron_fsdp=True))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ["(0, 0)", f"(0, 0, {rank})"], r["layout"]
        assert set(r["max_delta"]) == COMPONENTS and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert RNG.same(r["loaded"], r["saved"]) and r["warnings"] == []


def test_fsdp_old_layout_loads_patched_with_warning(tmp_path):
    """Saved by unfixed verl: the fixed load restores the shared copy (as unfixed verl does) and says
    so, naming the old layout, never silently keeping the template's state."""
    saved = [r["saved"] for r in RNG.ok(RNG.world("save_only", False, tmp_path, use_megatron_fsdp=True))]
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, tmp_path, use_megatron_fsdp=True))):
        assert len(r["warnings"]) == 1, r["warnings"]
        (w,) = r["warnings"]
        assert w.startswith("MegatronPatchWarning: mcore_ckpt_fixes: rng-under-ep: ") and FSDP_OLD_LAYOUT in w, w
        assert f"(pp 0, tp 0, dp_cp {rank})" in w, w
        for k in COMPONENTS:
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
        assert not RNG.same(r["loaded"], r["before"]), rank  # restored from the checkpoint, not kept


# -- the source patch (patches/rng-under-ep/verl-0.9.1.patch) ---------------------------------------

_SOURCE_RUN = r"""
import json, os, pickle, warnings
warnings.simplefilter("ignore")
import verl
assert verl.__path__[0] == os.environ["PATCHED_VERL"], verl.__path__
import verl.utils.checkpoint.megatron_checkpoint_manager as m
from mcore_ckpt_fixes.fixes.rng_under_ep.runtime.verl import probe
verdict, why = probe(m)
from mcore_ckpt_fixes.fixes.rng_under_ep.checks.verl import prepare
prepare()
from mcore_ckpt_fixes.testing.launcher import run_world, values
SC = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.verl"
off = {"MCORE_CKPT_FIXES": "off"}
out = {"probe": (verdict, why)}
for fsdp in (False, True):
    d = os.path.join(os.environ["WORK"], f"ckpt-{fsdp}")
    out[f"round_trip-{fsdp}"] = values(run_world(f"{SC}:round_trip", 2, {"ckpt_dir": d, "patched": False,
                                       "use_megatron_fsdp": fsdp}, env=off, timeout=240))
out["old_layout"] = values(run_world(f"{SC}:load_only", 2, {"ckpt_dir": os.environ["OLD_CKPT"], "patched": False},
                                     env=off, timeout=240))
with open(os.environ["RESULT"], "wb") as f:
    pickle.dump(out, f)
"""


def test_source_patch(old_ckpt, tmp_path):
    """The diff applied to verl 0.9.1's own file, the monkeypatch off: the probe says fixed, both
    round trips are exact on every rank, and an unfixed verl's checkpoint loads with a warning."""
    import pickle

    import verl

    patch_file = os.path.join(ROOT, "patches", "rng-under-ep", "verl-0.9.1.patch")
    shutil.copytree(os.path.dirname(verl.__file__), tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(["patch", "-p1", "--forward", "-i", patch_file], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(
        PYTHONPATH=str(tmp_path),  # the patched verl shadows the installed one
        PATCHED_VERL=str(tmp_path / "verl"),
        WORK=str(tmp_path),
        OLD_CKPT=str(old_ckpt[0]),
        RESULT=str(tmp_path / "result.pkl"),
    )
    proc = run_py(_SOURCE_RUN, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "result.pkl", "rb") as f:
        out = pickle.load(f)
    assert out["probe"][0] is False, out["probe"]
    for fsdp in (False, True):
        results = RNG.ok(out[f"round_trip-{fsdp}"])
        RNG.ranks_differ([r["saved"] for r in results])
        for rank, r in enumerate(results):
            assert r["fix_state"] == {MODULE: "disabled"}, r["fix_state"]
            expected = ["(0, 0)", f"(0, 0, {rank})"] if fsdp else ([1, 1, 2], [0, 0, rank], 0)
            assert r["layout"] == expected and RNG.same(r["loaded"], r["saved"]) and r["warnings"] == [], (fsdp, rank)
    for rank, r in enumerate(RNG.ok(out["old_layout"])):
        assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("UserWarning: "), r["warnings"]
        assert OLD_LAYOUT in r["warnings"][0] and f"(pp 0, tp 0, dp_cp {rank})" in r["warnings"][0], r["warnings"]
        assert RNG.same(r["loaded"], old_ckpt[1][0]), rank
