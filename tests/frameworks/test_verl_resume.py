"""The resume check through verl 0.9.1's own ``MegatronCheckpointManager``.

Configuration ``moe-ep2-verl`` (mcore_ckpt_fixes/resume/configs.py, job in
mcore_ckpt_fixes/resume/verl.py): the MoE GPT of ``moe-ep2`` (EP=2 on 2 forked gloo ranks, one local
expert per EP rank, Megatron's DDP and distributed optimizer on the FusedAdam stand-in, dropout,
router noise in the tracker's expert-parallel stream), seeded by verl's ``set_random_seed``, run B
saving with the manager's ``save_checkpoint`` (model, optimizer with the scheduler, extra: the RNG
states) and run C (new processes) loading with its ``load_checkpoint``. A and C compared bit for bit
per rank.

With the fixes: exact on both ranks (rng-under-ep's verl target gives every rank its own RNG entry).
Without them: verl's ``get_rng_state`` keys the ``torch_dist`` RNG entry by (pp, tp) with the
data-parallel rank as replica id, so EP rank 1 resumes on EP rank 0's streams: its first resumed step
differs and its expert-parallel stream ends elsewhere, while EP rank 0's first resumed step is exact
(the next differs: gradients are reduced across the EP ranks). Stand-ins: those of
mcore_ckpt_fixes/testing/gpt_job.py, and verl's device probes answering as on a CUDA host, so that verl
saves the (stood-in) CUDA generator as it does on a GPU (mcore_ckpt_fixes/resume/verl.py).
"""

from __future__ import annotations

import pytest
from conftest import resume_fail_text

from framework_import import import_framework
from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import by_name

FRAMEWORK = "verl"
CFG = by_name("moe-ep2-verl")
EXPERT_STREAM = "rng:tracker:expert-parallel-rng"


@pytest.fixture(scope="module")
def checked():
    """The check once for the module (A, then B and C with the fixes on and with every fix off)."""
    import_framework(FRAMEWORK, CFG.requires)
    resume.prepare()
    return resume.check(CFG)


def test_verl_resume_exact_with_the_fixes(checked):
    out = checked["on"]
    assert out["verdict"] == "exact", resume_fail_text(out)
    # The run with the fixes that never resumes (it saves and trains on) is the release's own, bit for bit.
    assert out["unchanged"]["verdict"] == "exact", resume_fail_text(out["unchanged"])
    assert [(r["rank"], r["ep"]) for r in out["ranks"]] == [(0, 0), (1, 1)], out["ranks"]
    for r in out["ranks"]:
        assert r["steps"] == list(range(resume.RESUME_AT + 1, resume.STEPS + 1))  # every resumed step
        names = set(r["compared_all"])
        # parameters, optimizer state, scheduler, streams: 150 with the tied embeddings of pretrain_gpt
        assert r["n_compared"] >= 150, r["n_compared"]
        assert EXPERT_STREAM in names and {"rng:python", "rng:numpy", "rng:torch"} <= names, sorted(names)
        assert "scheduler:num_steps" in names and any("local_experts" in n for n in names), sorted(names)
        assert not [w for w in r["load_warnings"] if "MegatronPatchWarning" in w], r["load_warnings"]


def test_verl_resume_without_the_fixes_ep_rank_1_resumes_on_rank_0s_streams(checked):
    assert checked["needed_here"] == ["rng-under-ep"], checked["needed_here"]
    off = checked["off"]
    assert off["verdict"] == "inexact", resume_fail_text(off)
    first = resume.RESUME_AT + 1
    ep0, ep1 = sorted(off["ranks"], key=lambda r: r["ep"])
    assert (ep0["ep"], ep1["ep"]) == (0, 1), off["ranks"]
    assert ep1["first_step"] == first and EXPERT_STREAM in ep1["differ_all"], resume_fail_text(off)
    assert ep0["first_step"] == first + 1, resume_fail_text(off)
