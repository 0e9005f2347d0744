"""rng-under-ep: both halves on 0.17 / 0.18 / 0.19, not applicable on 0.16 (no megatron.training).

World 2, EP=2 (TP=PP=1: the two EP ranks are the two data-parallel ranks), gloo on CPU, a small real
GPTModel with one local expert per EP rank, saved and loaded with Megatron's own
``save_checkpoint`` / ``load_checkpoint`` (``torch_dist``, Megatron's default options, parsed by its
own ``parse_args`` / ``validate_args``). Why those two functions and what each world does: see
mcore_ckpt_fixes/fixes/rng_under_ep/checks/core.py.

Stand-in used (CPU workers only): one CPU ``torch.Generator`` plays the CUDA default generator
(``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed``, Megatron's ``_set_cuda_rng_state``),
and ``torch.tensor(..., device="cuda")`` (the iteration all-reduce in ``read_metadata``) makes a CPU
tensor: there is no CUDA here, and without the stand-in every tracker stream would hold one and the
same state. Everything RNG-related that is checkpointed is compared: Python ``random``, NumPy, torch
CPU, the (stand-in) CUDA generator and every stream of Megatron's RNG tracker.

Checkpoint formats across the fix (they move forward: a fixed load reads what an unfixed release
wrote, never silently): an unfixed release's 2-D checkpoint loads with the fix, with a
MegatronPatchWarning naming the old layout and the one copy it holds on every rank whose restored
state is not its own; a checkpoint written with the fix cannot have its RNG state read by an unfixed release (the
shard shape is part of the stored key): it stops with the exact error asserted below, and
``--no-load-rng`` is the way past it.
"""

import pytest

from conftest import check_py
from mcore_ckpt_fixes.fixes.rng_under_ep import FIX
from rng_worlds import RngWorlds
from mcore_ckpt_fixes.testing import for_fix

SC = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.core"
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
UNFIXED_READS_NEW = "RuntimeError: Missing key in checkpoint state_dict: rng_state/shard_0.0_1.1."


def _has_training(version):
    return version.release[:2] >= (0, 17)


def _need_training(version):
    if not _has_training(version):
        pytest.skip("megatron.training ships in the wheel from 0.17 (0.16: see test_not_applicable_before_017)")


@pytest.fixture(scope="module", autouse=True)
def warm_parent(mcore_version):
    """Import Megatron (megatron.training included) once here: every world below forks from this process."""
    if _has_training(mcore_version):
        from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import prepare

        prepare()


RNG = RngWorlds(SC, COMPONENTS, timeout=180)


# -- registry, status, engine ------------------------------------------------------------------------


def test_state_delta_tells_a_cached_gaussian_from_none():
    """Python ``random`` caches the second value of ``gauss()``; a rank resumed with or without it
    draws different numbers next, so two states that differ only there must compare different."""
    import random

    from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import delta

    gen = random.Random(7)
    gen.gauss(0.0, 1.0)
    cached = gen.getstate()
    none = (cached[0], cached[1], None)
    assert cached[2] is not None
    assert delta(cached, none) != 0.0 and delta(none, cached) != 0.0
    assert delta(cached, cached) == 0.0 and delta(none, none) == 0.0


def test_not_applicable_before_017(mcore_version):
    """0.16 has no megatron.training in the wheel: the fix says not-applicable, nothing is patched."""
    if _has_training(mcore_version):
        pytest.skip("megatron.training is in this wheel (see test_status_and_probe)")
    out = check_py(
        """
        import json, mcore_ckpt_fixes
        from mcore_ckpt_fixes.cli.status import import_targets
        import_targets()
        row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["rng-under-ep"]
        print(json.dumps(row))
        """
    )
    import json

    row = json.loads(out.strip().splitlines()[-1])
    assert row["state"] == "not-applicable", row
    assert "cannot import megatron.training.checkpointing" in row["reason"] and "megatron.training" in row["reason"], (
        row
    )


def test_status_and_probe(mcore_version):
    _need_training(mcore_version)
    import megatron.training.checkpointing as m

    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.engine.patching import original
    from mcore_ckpt_fixes.fixes.rng_under_ep.runtime import core as f

    mcore_ckpt_fixes.apply()
    row = next(r for r in mcore_ckpt_fixes.report() if r["id"] == FIX.id)
    assert mcore_version in FIX.specifiers and row["state"] == "applied", row
    assert m.get_rng_state is f.get_rng_state
    assert m._load_global_dist_base_checkpoint is f.load_global_dist_base_checkpoint
    assert "keys the torch_dist RNG state by (pp, tp) only" in row["reason"], row
    assert "both address rng_state/shard_0.0_1.1 and rank 1 is a replica (replica_id=1)" in row["reason"], row
    # The probe ran the original on stand-ins and put the module's own names back.
    assert m.get_args.__module__ == "megatron.training.global_vars" and m.torch.__name__ == "torch"
    assert original(m, "get_rng_state").__module__ == "megatron.training.checkpointing"


@pytest.mark.one_line  # the engine's rebinding, reload, pickle and revert, which tests/engine/test_lifecycle.py checks for every fix on every line
def test_rebind_reload_revert_pickle(mcore_version):
    """``from megatron.training.checkpointing import get_rng_state`` made before the fix is rebound;
    apply twice is one layer; the replacements pickle by reference; revert restores the originals."""
    _need_training(mcore_version)
    out = check_py(
        """
        import pickle, sys, types
        import megatron.training.checkpointing as m
        # In a list: the engine rebinds every module global that *is* the original, ours included.
        kept = [m.get_rng_state, m._load_global_dist_base_checkpoint]
        user = types.ModuleType("my_training_loop")
        exec("from megatron.training.checkpointing import get_rng_state", user.__dict__)
        sys.modules[user.__name__] = user
        import mcore_ckpt_fixes
        from mcore_ckpt_fixes.fixes.rng_under_ep.runtime import core as f
        assert m.get_rng_state is f.get_rng_state and user.get_rng_state is f.get_rng_state
        assert m._load_global_dist_base_checkpoint is f.load_global_dist_base_checkpoint
        mcore_ckpt_fixes.apply(); mcore_ckpt_fixes.apply()
        from mcore_ckpt_fixes.engine.patching import original
        assert original(m, "get_rng_state") is kept[0]
        assert original(m, "_load_global_dist_base_checkpoint") is kept[1]
        assert pickle.loads(pickle.dumps(m.get_rng_state)) is f.get_rng_state
        assert pickle.loads(pickle.dumps(m._load_global_dist_base_checkpoint)) is f.load_global_dist_base_checkpoint
        mcore_ckpt_fixes.revert()
        assert m.get_rng_state is kept[0] and user.get_rng_state is kept[0]
        assert m._load_global_dist_base_checkpoint is kept[1]
        print("OK")
        """
    )
    assert out.strip().endswith("OK")


# -- the round trip in one world (the registered scenario) ------------------------------------------


def test_unpatched_ep_rank1_restores_rank0(tmp_path, mcore_version):
    _need_training(mcore_version)
    results = RNG.world("ep2_round_trip", False, tmp_path)
    saved = [r["saved"] for r in results]
    RNG.ranks_differ(saved)
    r0, r1 = results
    # Unfixed: one (pp, tp) = (0, 0) object, the DP/EP ranks are declared replicas of each other.
    assert r0["layout"] == ([1, 1], [0, 0], 0) and r1["layout"] == ([1, 1], [0, 0], 1), (r0["layout"], r1["layout"])
    assert r0["error"] is None and set(r0["max_delta"].values()) == {0.0}, r0["max_delta"]
    assert r1["phase"] == "compare" and r1["error"].startswith("AssertionError: RNG states differ after load"), r1[
        "error"
    ]
    # Exactly: EP rank 1 resumes on EP rank 0's states, in every component.
    assert RNG.same(r1["loaded"], saved[0]), {k: RNG.delta(r1["loaded"][k], saved[0][k]) for k in COMPONENTS}
    assert all(d != 0.0 for d in r1["max_delta"].values()), r1["max_delta"]
    assert r0["model_max_delta"] == 0.0 and r1["model_max_delta"] == 0.0  # the experts themselves are fine
    assert r0["warnings"] == [] and r1["warnings"] == []
    assert for_fix(FIX.id)[0].bug.seen_in(results)  # selftest's judgement agrees


def test_patched_round_trip_is_exact(tmp_path, mcore_version):
    _need_training(mcore_version)
    results = RNG.ok(RNG.world("ep2_round_trip", True, tmp_path))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ([1, 1, 2], [0, 0, rank], 0), r["layout"]  # (pp, tp, dp_cp), every rank writes
        assert set(r["max_delta"]) == COMPONENTS and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert RNG.same(r["loaded"], r["saved"]) and r["model_max_delta"] == 0.0
        assert r["fix_state"] == {"megatron.training.checkpointing": "applied"} and r["warnings"] == []


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_data_parallel_random_init_round_trip(patched, tmp_path, mcore_version):
    """With --data-parallel-random-init the state list is gathered over DP, so even the unfixed
    layout holds every rank's state (the bug needs the default flags); the fixed layout keeps it."""
    _need_training(mcore_version)
    results = RNG.ok(RNG.world("ep2_round_trip", patched, tmp_path, data_parallel_random_init=True))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert set(r["max_delta"].values()) == {0.0} and RNG.same(r["loaded"], r["saved"]), r["max_delta"]
        assert r["layout"] == (([1, 1, 2], [0, 0, rank], 0) if patched else ([1, 1], [0, 0], rank))


# -- checkpoints across the fix: written in one world, loaded in a fresh one ------------------------


@pytest.fixture(scope="module")
def old_ckpt(tmp_path_factory, mcore_version):
    """A checkpoint in the unfixed 2-D layout, written by the unfixed release (fix off)."""
    _need_training(mcore_version)
    d = tmp_path_factory.mktemp("rng-old-layout")
    return d, [r["saved"] for r in RNG.ok(RNG.world("save_only", False, d))]


@pytest.fixture(scope="module")
def new_ckpt(tmp_path_factory, mcore_version):
    """A checkpoint in the per-rank (pp, tp, dp_cp) layout, written with the fix."""
    _need_training(mcore_version)
    d = tmp_path_factory.mktemp("rng-new-layout")
    return d, [r["saved"] for r in RNG.ok(RNG.world("save_only", True, d))]


def test_new_layout_loads_patched_after_restart(new_ckpt):
    d, saved = new_ckpt
    RNG.ranks_differ(saved)
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, d))):
        assert not RNG.same(r["before"], saved[rank])  # the fresh world had other states
        assert RNG.same(r["loaded"], saved[rank]) and r["warnings"] == [], rank


def test_old_layout_loads_patched_with_warning(old_ckpt):
    """The unfixed checkpoint holds one copy for (pp, tp) = (0, 0): both ranks restore it (the best
    state there is: rank 0's own). Rank 1, whose restored state is not its own, is told so, naming
    the old layout; rank 0 gets its own state back and is not warned (it logs the text instead)."""
    d, saved = old_ckpt
    RNG.ranks_differ(saved)
    r0, r1 = RNG.ok(RNG.world("load_only", True, d))
    assert r0["warnings"] == [] and RNG.same(r0["loaded"], saved[0])
    assert len(r1["warnings"]) == 1, r1["warnings"]
    (w,) = r1["warnings"]
    assert w.startswith("MegatronPatchWarning: mcore_ckpt_fixes: rng-under-ep: ") and OLD_LAYOUT in w, w
    assert "this rank (pp 0, tp 0, dp_cp 1) restores that copy" in w, w
    assert RNG.same(r1["loaded"], saved[0])


def test_old_layout_with_data_parallel_random_init_restores_every_rank(tmp_path, mcore_version):
    """Where the unfixed layout does hold every rank's state (the DP-gathered list), the fixed load
    restores each rank's own: no rank is warned (each logs the old-layout text instead)."""
    _need_training(mcore_version)
    saved = [r["saved"] for r in RNG.ok(RNG.world("save_only", False, tmp_path, data_parallel_random_init=True))]
    RNG.ranks_differ(saved)
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, tmp_path, data_parallel_random_init=True))):
        assert r["warnings"] == [], r["warnings"]
        assert RNG.same(r["loaded"], saved[rank]), rank


def test_unfixed_release_cannot_read_new_layout_rng(new_ckpt):
    """Impossible by construction: the unfixed load asks for the 2-D key, the checkpoint has the
    per-rank keys. It stops loudly in load_checkpoint (never restores a wrong state silently)."""
    d, _ = new_ckpt
    for rank, r in enumerate(RNG.world("load_only", False, d)):
        assert r["phase"] == "load", (rank, r["phase"], r["error"])
        assert r["error"].startswith("CheckpointException: ") and UNFIXED_READS_NEW in r["error"], (rank, r["error"])
        assert r["loaded"] is None


def test_unfixed_release_loads_new_layout_with_no_load_rng(new_ckpt):
    """The way past it without the fix: --no-load-rng loads everything else and keeps the fresh RNG."""
    d, _ = new_ckpt
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", False, d, no_load_rng=True))):
        assert RNG.same(r["loaded"], r["before"]) and r["warnings"] == [], rank


def test_request_follows_the_stored_layout(new_ckpt, old_ckpt):
    """What the fixed load asks for, decided from the real checkpoints' metadata, for the layouts a
    data-parallel resize or an old checkpoint brings (the worlds above cover the same-size cases)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from mcore_ckpt_fixes.fixes.rng_under_ep.runtime.old_layouts import align_rng_request

    new_dir, old_dir = (str(new_ckpt[0] / "iter_0000001"), str(old_ckpt[0] / "iter_0000001"))

    def ask(ckpt_dir, dp_cp_size, dp_cp_rank):
        template = ShardedObject("rng_state", ["state"], (1, 1, dp_cp_size), (0, 0, dp_cp_rank), 0)
        request, warning = align_rng_request(template, ckpt_dir)
        return template, request, warning

    template, request, warning = ask(new_dir, 2, 1)  # same size: unchanged
    assert request is template and warning is None
    # DP shrank: no rank asks (a ShardedObject loads only whole, and fewer ranks cannot cover every
    # stored shard: the load would stop with "ShardedObject are missing"); each keeps its own state.
    _, request, warning = ask(new_dir, 1, 0)
    assert request is None and "holds RNG states for 2 dp_cp ranks (saved with a larger" in warning, warning
    _, request, warning = ask(new_dir, 3, 1)  # DP grew, rank within the stored extent
    assert (request.global_shape, request.global_offset, warning) == ((1, 1, 2), (0, 0, 1), None)
    _, request, warning = ask(new_dir, 3, 2)  # DP grew, rank beyond it: nothing to load, keep own state
    assert request is None and "holds RNG states for dp_cp ranks 0..1 only" in warning, warning
    _, request, warning = ask(old_dir, 2, 1)  # old layout: the (pp, tp) copy, as the unfixed load asks
    assert (request.global_shape, request.global_offset, request.replica_id) == ((1, 1), (0, 0), 1)
    assert OLD_LAYOUT in warning and "(pp 0, tp 0, dp_cp 1)" in warning, warning


# -- the source patch (patches/rng-under-ep) reads the old layout too --------------------------------

_SOURCE_LOAD = r"""
import os, pickle, sys
import megatron
assert megatron.__path__[0] == os.environ["PATCHED_MEGATRON"], megatron.__path__
from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import prepare
prepare()
from mcore_ckpt_fixes.testing.launcher import run_world, values
results = values(run_world("mcore_ckpt_fixes.fixes.rng_under_ep.checks.core:load_only", 2,
                           {"ckpt_dir": os.environ["CKPT_DIR"], "patched": False},
                           env={"MCORE_CKPT_FIXES": "off"}, timeout=180))
with open(os.environ["RESULT"], "wb") as f:
    pickle.dump(results, f)
"""


def test_source_patch_reads_old_layout(old_ckpt, tmp_path, mcore_version):
    """tests/patches/test_source_patches.py runs the registered round trip on the patched source;
    this is the other half of its load side: an unfixed release's checkpoint, loaded by the
    patched source with the monkeypatch off, restores the one copy it holds, with a warning."""
    import os
    import pickle
    import shutil
    import subprocess

    from conftest import ROOT, run_py
    from mcore_ckpt_fixes.engine.version import detect

    d, saved = old_ckpt
    patch_file = os.path.join(ROOT, "patches", FIX.id, f"{mcore_version}.patch")
    shutil.copytree(detect().path, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(["patch", "-p1", "--forward", "-i", patch_file], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(
        PYTHONPATH=str(tmp_path),  # the patched Megatron-Core shadows the installed one
        PATCHED_MEGATRON=str(tmp_path / "megatron"),
        CKPT_DIR=str(d),
        RESULT=str(tmp_path / "result.pkl"),
    )
    proc = run_py(_SOURCE_LOAD, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "result.pkl", "rb") as f:
        results = pickle.load(f)
    for rank, r in enumerate(RNG.ok(results)):
        assert r["fix_state"] == {"megatron.training.checkpointing": "disabled"}, r["fix_state"]
        assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("UserWarning: "), r["warnings"]
        assert OLD_LAYOUT in r["warnings"][0] and f"(pp 0, tp 0, dp_cp {rank})" in r["warnings"][0], r["warnings"]
        assert RNG.same(r["loaded"], saved[0]), rank


# -- fsdp_dtensor (Megatron-FSDP users' format): the same bug in the plain RNG entry ----------------
# The model is not wrapped in Megatron-FSDP (its CUDA buffers cannot be built on a CPU host; the RNG
# entry does not depend on the wrapper): the real get_rng_state, save_checkpoint and load_checkpoint
# go through their fsdp_dtensor branches (see round_trips._setup).

FSDP_OLD_LAYOUT = "it was written before rng-under-ep covered fsdp_dtensor"


def test_fsdp_dtensor_unpatched_ranks_restore_a_mix(tmp_path, mcore_version):
    """One entry per (pp, tp): DCP keeps one copy of each leaf, the tensors from one rank and the
    objects from the other, so neither rank gets its own states back."""
    _need_training(mcore_version)
    r0, r1 = RNG.world("ep2_fsdp_dtensor", False, tmp_path)
    saved = [r0["saved"], r1["saved"]]
    RNG.ranks_differ(saved)
    assert r0["layout"] == ["(0, 0)"] and r1["layout"] == ["(0, 0)"], (r0["layout"], r1["layout"])
    for rank, r in enumerate((r0, r1)):
        assert r["phase"] == "compare" and r["error"].startswith("AssertionError: RNG states differ after load"), r[
            "error"
        ]
        assert r["model_max_delta"] == 0.0 and r["warnings"] == []
        # Every component is one of the two ranks' saved states, and some are the other rank's.
        for k in COMPONENTS:
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
        assert any(RNG.delta(r["loaded"][k], saved[rank][k]) != 0.0 for k in COMPONENTS), rank
    from mcore_ckpt_fixes.testing import Bug

    assert Bug.wrong_values().seen_in([r0, r1])


def test_fsdp_dtensor_patched_round_trip_is_exact(tmp_path, mcore_version):
    _need_training(mcore_version)
    results = RNG.ok(RNG.world("ep2_fsdp_dtensor", True, tmp_path))
    RNG.ranks_differ([r["saved"] for r in results])
    for rank, r in enumerate(results):
        assert r["layout"] == ["(0, 0)", f"(0, 0, {rank})"], r["layout"]  # the release's entry + this rank's own
        assert set(r["max_delta"]) == COMPONENTS and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert RNG.same(r["loaded"], r["saved"]) and r["model_max_delta"] == 0.0 and r["warnings"] == []


@pytest.fixture(scope="module")
def fsdp_old_ckpt(tmp_path_factory, mcore_version):
    _need_training(mcore_version)
    d = tmp_path_factory.mktemp("rng-fsdp-old")
    return d, [r["saved"] for r in RNG.ok(RNG.world("save_only", False, d, ckpt_format="fsdp_dtensor"))]


@pytest.fixture(scope="module")
def fsdp_new_ckpt(tmp_path_factory, mcore_version):
    _need_training(mcore_version)
    d = tmp_path_factory.mktemp("rng-fsdp-new")
    return d, [r["saved"] for r in RNG.ok(RNG.world("save_only", True, d, ckpt_format="fsdp_dtensor"))]


def test_fsdp_dtensor_old_layout_loads_patched_with_warning(fsdp_old_ckpt):
    """What an unfixed release wrote: the fixed load restores the shared copy, as the unfixed load
    does (the same values on both ranks), and says so, naming the old layout."""
    d, saved = fsdp_old_ckpt
    RNG.ranks_differ(saved)
    fixed = RNG.ok(RNG.world("load_only", True, d, ckpt_format="fsdp_dtensor"))
    unfixed = RNG.world("load_only", False, d, ckpt_format="fsdp_dtensor")
    for rank, (r, u) in enumerate(zip(fixed, unfixed)):
        assert len(r["warnings"]) == 1, r["warnings"]
        (w,) = r["warnings"]
        assert w.startswith("MegatronPatchWarning: mcore_ckpt_fixes: rng-under-ep: ") and FSDP_OLD_LAYOUT in w, w
        assert f"(pp 0, tp 0, dp_cp {rank})" in w, w
        assert u["error"] is None and RNG.same(r["loaded"], u["loaded"]), rank
        # The shared copy is what was saved: every component one of the two ranks' saved states,
        # restored from the checkpoint, not the fresh states kept.
        for k in COMPONENTS:
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
        assert not RNG.same(r["loaded"], r["before"]), rank
    assert RNG.same(fixed[0]["loaded"], fixed[1]["loaded"])  # one copy, on both ranks


def test_fsdp_dtensor_new_layout_loads_after_restart_and_on_an_unfixed_release(fsdp_new_ckpt):
    """Written with the fix: the fixed load restores every rank's own states; an unfixed release
    reads it as it reads its own checkpoints (the release's entry is kept), never failing."""
    d, saved = fsdp_new_ckpt
    RNG.ranks_differ(saved)
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", True, d, ckpt_format="fsdp_dtensor"))):
        assert not RNG.same(r["before"], saved[rank]) and RNG.same(r["loaded"], saved[rank]) and r["warnings"] == [], (
            rank
        )
    for rank, r in enumerate(RNG.ok(RNG.world("load_only", False, d, ckpt_format="fsdp_dtensor"))):
        for k in COMPONENTS:
            assert RNG.delta(r["loaded"][k], saved[0][k]) == 0.0 or RNG.delta(r["loaded"][k], saved[1][k]) == 0.0, (
                rank,
                k,
            )
