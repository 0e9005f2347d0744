"""What a job's log holds with the fixes on: at most one INFO line per job at start (global rank 0's
summary), the details at DEBUG on every rank, and a warning only on a rank whose restored state is
not its own.

A 4-rank job, each rank a fresh interpreter (spawn) that imports every module the fixes target and
then, where ``megatron.training`` exists (0.17+), resumes with Megatron's own ``load_checkpoint``
from a checkpoint an unfixed release wrote: the old 2-D RNG layout holds one copy per (pp, tp),
written by data-parallel rank 0, so rank 0 gets its own state back and ranks 1-3 get rank 0's.
"""

import os

from mcore_ckpt_fixes.testing.launcher import run_world, values

HERE = os.path.dirname(os.path.abspath(__file__))
RNG = "mcore_ckpt_fixes.fixes.rng_under_ep.checks.core"
NPROC = 4


def _levels(records, level):
    return [message for lvl, message in records if lvl == level]


def _old_layout_checkpoint(ckpt_dir):
    """What an unfixed release writes: the same 4-rank job, the fixes off (forked ranks: cheap)."""
    from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import prepare

    prepare()
    kwargs = {"ckpt_dir": str(ckpt_dir), "patched": False}
    return [r["saved"] for r in values(run_world(f"{RNG}:save_only", NPROC, kwargs, env={"MCORE_CKPT_FIXES": "off"}))]


def test_a_4_rank_job_logs_one_info_line_and_warns_only_where_state_is_not_its_own(tmp_path, mcore_version):
    training = mcore_version.release[:2] >= (0, 17)
    saved = _old_layout_checkpoint(tmp_path) if training else None
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    kwargs = {"ckpt_dir": str(tmp_path) if training else None}
    ranks = values(run_world("log_scenarios:import_then_load", NPROC, kwargs, method="spawn", env=env, timeout=600))
    assert all(r["megatron_before"] == [] for r in ranks), "Megatron was imported before the records were kept"

    # Start: one INFO line in the whole job, global rank 0's summary of what was applied; every other
    # rank has the same summary at DEBUG, every rank each target's decision; no warning anywhere.
    infos = [(rank, m) for rank, r in enumerate(ranks) for m in _levels(r["start"], "INFO")]
    assert len(infos) == 1 and infos[0][0] == 0, infos
    assert infos[0][1].startswith("mcore_ckpt_fixes: applied "), infos
    for rank, r in enumerate(ranks):
        debug = _levels(r["start"], "DEBUG")
        if rank:
            assert infos[0][1] in debug, (rank, debug)  # rank 0's INFO line, at DEBUG
        assert any(": applied: " in m for m in debug), (rank, debug)  # each target's decision, with why
        assert _levels(r["start"], "WARNING") == [] and r["start_warnings"] == [], (rank, r["start"])
    if not training:
        return

    # The load: rank 0 restores its own state (no warning; the old layout named once, at INFO);
    # ranks 1-3 restore rank 0's copy and each is warned, naming the old layout and its own place.
    from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import assert_ranks_differ, same_states

    components = set(saved[0])
    assert_ranks_differ(saved, components)  # restoring another rank's state is visible
    for rank, r in enumerate(ranks):
        rt = r["round_trip"]
        assert rt["error"] is None, (rank, rt["phase"], rt["error"])
        assert same_states(rt["loaded"], saved[0], components), rank  # the one copy there is
    warned = [len(r["load_warnings"]) for r in ranks]
    assert warned == [0, 1, 1, 1], [r["load_warnings"] for r in ranks]
    for rank, r in enumerate(ranks[1:], start=1):
        (w,) = r["load_warnings"]
        assert "old 2-D (pp, tp) layout" in w and f"(pp 0, tp 0, dp_cp {rank}) restores that copy" in w, w
    load_infos = [(rank, m) for rank, r in enumerate(ranks) for m in _levels(r["load"], "INFO")]
    assert len(load_infos) == 1 and load_infos[0][0] == 0 and "old 2-D (pp, tp) layout" in load_infos[0][1], load_infos
    assert all(_levels(r["load"], "WARNING") == [] for r in ranks)
