"""mimo-optimizer: both halves on every release line, real MimoOptimizer over real DistributedOptimizers.

Non-colocated modules, gloo on CPU: world 2 (language on rank 0, vision on rank 1) and world 4
(TP=2 per module). Inner sharding type ``dp_reshardable``: on CPU the other DistributedOptimizer
types do not round-trip for reasons outside MIMO (see mcore_ckpt_fixes/fixes/mimo_optimizer/checks/core.py).
What is shimmed there, in the worker only: ``device="cuda"`` allocations, ``Tensor.cuda()`` and
``Tensor.type()`` names (a TorchFunctionMode), besides testing/_cpu_shims.py.
"""

import json

import pytest

from conftest import run_cli

from mcore_ckpt_fixes.fixes.mimo_optimizer import FIX
from mcore_ckpt_fixes.testing.launcher import run_world, values
from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.scenarios import (
    MIMO_SAVE_SIDE,
    MIMO_STEP_BUG,
    MIMO_WORLD2_BUG,
    MIMO_WORLD4_BUG,
)
from mcore_ckpt_fixes.testing import for_fix, resolve

SCENARIO, ADAM = for_fix("mimo-optimizer")
WORLDS = {"world2": (2, MIMO_WORLD2_BUG), "world4_tp2": (4, MIMO_WORLD4_BUG)}


def _has_mimo_optimizer():
    try:
        import megatron.core.models.mimo.optimizer  # noqa: F401
    except ImportError:
        return False
    return True


def _need_mimo(version):
    if not _has_mimo_optimizer():
        assert version not in FIX.specifiers
        pytest.skip("megatron.core.models.mimo ships from 0.17 (0.16: not-applicable, see test_status_on_this_release)")


def test_registry_declares_the_round_trip():
    """The documented errors, pinned: the unpatched tests compare the worlds with these constants
    (the form of every fix's registry: tests/fixes/test_every_fix.py)."""
    assert SCENARIO.bug == {MIMO_SAVE_SIDE: MIMO_WORLD2_BUG}  # 0.19: no fix-off failure in this round trip
    assert (MIMO_STEP_BUG.phase, MIMO_STEP_BUG.error) == ("load_state_dict", "KeyError: 'step'")
    for bug, idxs in ((MIMO_WORLD2_BUG, (0,)), (MIMO_WORLD4_BUG, (0, 1))):
        assert bug.kind == "raises" and bug.phase == "save"
        assert bug.error.startswith("CheckpointingException: Invalid sharding pattern validation. Errors: ")
        for i in idxs:
            assert (
                f"Duplicate ShardedObject keys: ['optimizer.distributed.dp_group_idx_{i}.optimizer/shard_0_1']"
                in bug.error
            )


@pytest.fixture(scope="module", autouse=True)
def warm_parent():
    resolve(SCENARIO.prepare)()


def _run(world, patched, tmp_path):
    nproc, _ = WORLDS[world]
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    return values(
        run_world(SCENARIO.func, nproc, {"ckpt_dir": str(tmp_path), "patched": patched}, env=env, timeout=300)
    )


def _assert_exact(results, expected_state):
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert r["bad_groups"] == [] and r["sharding_type"] == "dp_reshardable", (rank, r)
        assert r["fix_state"] == {"megatron.core.models.mimo.optimizer": expected_state}, (rank, r["fix_state"])
    assert [r["module"] for r in results] == ["language"] * (len(results) // 2) + ["vision"] * (len(results) // 2)


def test_status_on_this_release(mcore_version):
    """``status`` (a fresh interpreter, as a user runs it) names this release's verdict: the state in
    its text line, the whole reason in ``--json`` (the text wraps and shortens long reasons)."""
    proc = run_cli(["status"])
    text = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("mimo-optimizer "))
    row = next(r for r in json.loads(run_cli(["status", "--json"]).stdout) if r["id"] == "mimo-optimizer")
    assert text.split()[1] == row["state"], (text, row["state"])
    line = f" {row['state']} {row['reason']}"
    if not _has_mimo_optimizer():  # 0.16: the module does not exist
        assert mcore_version not in FIX.specifiers
        assert " not-applicable " in line and "No module named" in line, line
    elif mcore_version in FIX.specifiers:
        assert " applied " in line, line
        # The probe names each defect it found: (a)-(d) on 0.17, the key collision on 0.18, and the
        # common state on every one; and on every one that the load cannot read old layouts.
        found = {d for d in "abcde" if f"({d}) " in line}
        series = mcore_version.release[:2]
        assert found == {(0, 17): set("abcde"), (0, 18): {"d", "e"}, (0, 19): {"e"}}[series], line
        if series < (0, 19):
            assert "(d) inner keys are not prefixed by module" in line, line
        assert "(e) a module's plain optimizer state (e.g. torch Adam's common_step) stays in the common state" in line
        assert "dist_checkpointing.load cannot read the MIMO optimizer layouts unfixed releases wrote" in line, line
    else:
        assert " not-needed " in line, line


@pytest.mark.parametrize("world", list(WORLDS))
def test_unpatched(world, tmp_path, mcore_version):
    _need_mimo(mcore_version)
    results = _run(world, False, tmp_path)
    bug = WORLDS[world][1]
    if SCENARIO.bug_for(mcore_version) is not None:  # 0.19: the save side is upstream's (load side: the matrix)
        for rank, r in enumerate(results):
            assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r["phase"], r["error"])
        # Megatron raises on global rank 0 (its validation runs there); the others learn it.
        assert results[0]["rank_errors"][0] == bug.error
        assert bug.seen_in(results)
    else:
        _assert_exact(results, "disabled")
        assert not bug.seen_in(results)


@pytest.mark.parametrize("world", list(WORLDS))
def test_patched_round_trip_is_exact(world, tmp_path, mcore_version):
    _need_mimo(mcore_version)
    results = _run(world, True, tmp_path)
    _assert_exact(results, "applied" if mcore_version in FIX.specifiers else "not-needed")
    assert all(r["warnings"] == [] for r in results)  # a current-layout checkpoint: no warning


# The language model with a non-distributed optimizer beside a DistributedOptimizer vision encoder:
# no inner keys collide (defect (d) stays out of the way), so with TP=2 per module (world 4) what
# unpatched 0.17 shows is defect (c): both TP ranks of a module claim to be the main replica of its
# param groups. 0.18 fixed (c), so its own round trip is exact with the fix off.
MIXED = {"language": "non_distributed", "vision": "dp_reshardable"}
# Raised by Megatron's validation on global rank 0 (the scenario shares it with the other ranks).
MIMO_TP_REPLICA_ERROR = (
    "CheckpointingException: Invalid sharding pattern validation. Errors: Duplicate ShardedObject keys: "
    "['optimizer.mimo.language.param_groups/shard_0_1']\nInvalid access pattern: -1 ShardedObject are missing."
)


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_world4_tp2_mixed_optimizers(patched, tmp_path, mcore_version):
    _need_mimo(mcore_version)
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    results = values(
        run_world(
            SCENARIO.func,
            4,
            {"ckpt_dir": str(tmp_path), "patched": patched, "sharding_type": MIXED},
            env=env,
            timeout=300,
        )
    )
    if not patched and mcore_version.release[:2] == (0, 17):
        for rank, r in enumerate(results):
            assert (r["phase"], r["error"]) == ("save", MIMO_TP_REPLICA_ERROR), (rank, r["phase"], r["error"])
        assert results[0]["rank_errors"] == [MIMO_TP_REPLICA_ERROR, None, None, None]
        return
    state = "disabled" if not patched else "applied"
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        expected_type = None if r["module"] == "language" else "dp_reshardable"
        assert r["bad_groups"] == [] and r["sharding_type"] == expected_type, (rank, r)
        assert r["fix_state"] == {"megatron.core.models.mimo.optimizer": state}, (rank, r["fix_state"])
        assert r["warnings"] == []
    assert [r["module"] for r in results] == ["language", "language", "vision", "vision"]


# Defect (e), the configuration of upstream's own MIMO checkpoint test (tests/unit_tests/models/
# mimo/test_mimo_checkpoint.py in 0.18/0.19: non-distributed optimizer, bf16, Adam; two modules on
# disjoint ranks, TP=1 each on 2 ranks and TP=2 each on 4): torch's AdamW keeps its step per
# parameter, Float16Optimizer saves it once as plain common state (``optimizer.state.common_step``),
# which only global rank 0 writes, so the module off rank 0 loads its Adam state without a step.
# Unpatched 0.17 with TP=2 stops earlier, at defect (c) (both TP ranks of a module write its param
# groups): the round trip's preflight shares rank 0's validation error with every rank, where a
# bare dist_checkpointing.save would leave the other ranks waiting in its collectives.
ADAM_TP2_REPLICA_ERROR = (
    "CheckpointingException: Invalid sharding pattern validation. Errors: "
    "Duplicate ShardedObject keys: ['optimizer.mimo.language.param_groups/shard_0_1']\n"
    "Invalid access pattern: -1 ShardedObject are missing.\n"
    "Duplicate ShardedObject keys: ['optimizer.mimo.vision.param_groups/shard_0_1']\n"
    "Invalid access pattern: -1 ShardedObject are missing."
)


@pytest.mark.parametrize("nproc", [2, 4], ids=["world2", "world4_tp2"])
def test_torch_adam_unpatched(nproc, tmp_path, mcore_version):
    _need_mimo(mcore_version)
    results = values(
        run_world(
            ADAM.func,
            nproc,
            {"ckpt_dir": str(tmp_path), "patched": False},
            env={"MCORE_CKPT_FIXES": "off"},
            timeout=300,
        )
    )
    assert [r["module"] for r in results] == ["language"] * (nproc // 2) + ["vision"] * (nproc // 2)
    if nproc == 4 and mcore_version.release[:2] == (0, 17):
        for rank, r in enumerate(results):
            assert (r["phase"], r["error"]) == ("save", ADAM_TP2_REPLICA_ERROR), (rank, r["phase"], r["error"])
        assert results[0]["rank_errors"] == [ADAM_TP2_REPLICA_ERROR, None, None, None]
        return
    bug = ADAM.bug_for(mcore_version)
    assert bug is MIMO_STEP_BUG and bug.seen_in(results), [(r["phase"], r["error"]) for r in results]
    # Raised by the inner optimizer load of every vision rank (global rank 0 holds the language
    # model, whose step the common state has); the round trip shares it with the language ranks.
    assert results[0]["rank_errors"] == [None] * (nproc // 2) + [MIMO_STEP_BUG.error] * (nproc // 2)
    assert "in __setstate__" in results[-1]["traceback"], results[-1]["traceback"]  # torch's Adam


@pytest.mark.parametrize("nproc", [2, 4], ids=["world2", "world4_tp2"])
def test_torch_adam_patched_round_trip_is_exact(nproc, tmp_path, mcore_version):
    from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core import SAVE_SEED, saved_step

    _need_mimo(mcore_version)
    results = values(run_world(ADAM.func, nproc, {"ckpt_dir": str(tmp_path), "patched": True}, timeout=300))
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        # exp_avg, exp_avg_sq and the fp32 main parameter of every parameter, bit for bit
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert {k.rsplit(".", 1)[1] for k in r["max_delta"]} == {"param", "exp_avg", "exp_avg_sq"}, r["max_delta"]
        # every param-group field (lr, betas, eps, weight decay, ...) and the step, the module's own
        assert r["bad_groups"] == [] and r["sharding_type"] is None, (rank, r["bad_groups"], r["sharding_type"])
        assert r["steps"] and r["steps"] == [saved_step(SAVE_SEED, r["module"])] * len(r["steps"]), (rank, r["steps"])
        assert r["fix_state"] == {"megatron.core.models.mimo.optimizer": "applied"}, (rank, r["fix_state"])
        assert r["warnings"] == [], (rank, r["warnings"])
    assert [r["module"] for r in results] == ["language"] * (nproc // 2) + ["vision"] * (nproc // 2)
    assert saved_step(SAVE_SEED, "language") != saved_step(SAVE_SEED, "vision")
