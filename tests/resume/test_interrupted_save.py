"""A save that dies halfway, with the fixes on: the job saves at step 2, trains step 3 and saves
again, and its last rank is killed in that save once its own shards are written (before the save's
metadata and Megatron's tracker file; mcore_ckpt_fixes/testing/_interrupt.py). The resumed job, in
new processes, must load step 2's checkpoint and continue exactly as the run that never stopped;
the doctor must name iteration 3 as an unfinished save and say what it lacks.

Asynchronous saves are not part of this: on a CPU host megatron.training cannot save asynchronously
(docs/resume.md, "Not run").
"""

from __future__ import annotations

import os

import pytest
from conftest import needs_megatron_training, on_this_line, resume_fail_text

from mcore_ckpt_fixes.doctor import inspect
from mcore_ckpt_fixes.resume import check
from mcore_ckpt_fixes.resume.configs import by_name

# What a DCP save writes last, after every rank's data (0.17 and 0.18 write common.pt first).
FINISHED_LAST = "no .metadata, no metadata.json (the save stopped before its coordinator finished)"


# On 0.19 and 0.17 (CI's time: 0.18 writes in 0.17's order, common.pt first).
NAMES = [n for n in ("gpt-pp2", "moe-ep2") if on_this_line(n, {"gpt-pp2": ((0, 17),), "moe-ep2": ((0, 17),)})]


@pytest.mark.parametrize("name", NAMES)
def test_a_save_killed_halfway_leaves_the_previous_checkpoint_to_resume_from_exactly(name, tmp_path):
    needs_megatron_training()
    cfg = by_name(name)
    check.prepare()
    uninterrupted, error, detail = check.run_phase(
        cfg, "uninterrupted", str(tmp_path / "a"), check.MODES["off"], "cpu", 240.0
    )
    assert error is None, detail
    ckpt = str(tmp_path / "ckpt")
    _, error, _ = check.run_phase(cfg, "interrupted", ckpt, check.MODES["on"], "cpu", 120.0)
    # The rank killed halfway through its save (SIGKILL, as an out-of-memory kill or a lost node ends it).
    assert (
        error
        == f"interrupted run: rank {cfg.world - 1}: rank {cfg.world - 1} exited without a result (killed by SIGKILL)"
    )

    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(check.RESUME_AT)
    report = inspect(ckpt)
    assert report.ok and report["iteration"] == check.RESUME_AT, report.problems
    (newer,) = report["newer_iterations"]
    assert newer["iteration"] == check.RESUME_AT + 1 and not newer["complete"], newer
    assert newer["state"] == f"incomplete: data files of {cfg.world} ranks, {FINISHED_LAST}", newer

    resumed, error, detail = check.run_phase(cfg, "resume", ckpt, check.MODES["on"], "cpu", 240.0)
    assert error is None, detail
    verdict = check.verdict_against(uninterrupted, resumed)
    assert verdict["verdict"] == "exact", resume_fail_text(verdict)
    assert [r["iteration"] for r in verdict["ranks"]] == [check.RESUME_AT] * cfg.world
