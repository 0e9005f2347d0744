"""The resume check through Megatron-Bridge 0.6.2's own ``save_checkpoint`` / ``load_checkpoint``.

Configuration ``moe-ep2-bridge`` (mcore_ckpt_fixes/resume/configs.py, job in
mcore_ckpt_fixes/resume/bridge.py): the MoE GPT of ``moe-ep2`` (EP=2 on 2 forked gloo ranks, one
local expert per EP rank, Megatron's DDP and distributed optimizer on the FusedAdam stand-in,
dropout, router noise in the tracker's expert-parallel stream), seeded by Bridge's
``_set_random_seed``, run B saving with Bridge's ``save_checkpoint`` in ``torch_dist`` and run C
(new processes) loading with its ``load_checkpoint``, a real Bridge ``ConfigContainer`` /
``GlobalState`` describing the job. A and C compared bit for bit per rank, Bridge's ``TrainState``
included.

Without the fixes it resumes exactly too: Bridge 0.6.2 keys its ``torch_dist`` RNG entry by
(pp, tp, dp_cp) with ``replica_id=0`` when EP > 1 (``get_rng_state``), so EP rank 1 restores its own
streams (rng-under-ep's Bridge target is its ``fsdp_dtensor`` entry, which needs Megatron-FSDP's CUDA
buffers and is checked by tests/frameworks/test_bridge.py's round trips), and the distributed
optimizer on the FusedAdam path needs no fix. Stand-ins: those of mcore_ckpt_fixes/testing/gpt_job.py, and
Transformer Engine for importing Bridge (mcore_ckpt_fixes/testing/_standins.py).
"""

from __future__ import annotations

import pytest
from conftest import resume_fail_text

from framework_import import import_framework
from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import by_name

FRAMEWORK = "megatron-bridge"
CFG = by_name("moe-ep2-bridge")
EXPERT_STREAM = "rng:tracker:expert-parallel-rng"
TRAIN_STATE = {
    f"bridge:train_state:{k}" for k in ("step", "consumed_train_samples", "floating_point_operations_so_far")
}


@pytest.fixture(scope="module")
def checked():
    """The check once for the module (A, then B and C with the fixes on and with every fix off)."""
    from mcore_ckpt_fixes.testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    import_framework(FRAMEWORK, CFG.requires)
    resume.prepare()
    return resume.check(CFG)


def _assert_exact_everywhere(out):
    assert out["verdict"] == "exact", resume_fail_text(out)
    assert [(r["rank"], r["ep"]) for r in out["ranks"]] == [(0, 0), (1, 1)], out["ranks"]
    for r in out["ranks"]:
        assert r["steps"] == list(range(resume.RESUME_AT + 1, resume.STEPS + 1))  # every resumed step
        names = set(r["compared_all"])
        # parameters, optimizer state, scheduler, streams: 150 with the tied embeddings of pretrain_gpt
        assert r["n_compared"] >= 150, r["n_compared"]
        assert EXPERT_STREAM in names and "rng:tracker:model-parallel-rng" in names, sorted(names)
        assert {"rng:python", "rng:numpy", "rng:torch"} <= names and TRAIN_STATE <= names, sorted(names)
        assert any(n.startswith("param:") and "local_experts" in n for n in names), sorted(names)
        assert any(":state" in n and n.endswith(":exp_avg_sq") for n in names), sorted(names)
        assert not [w for w in r["load_warnings"] if "MegatronPatchWarning" in w], r["load_warnings"]


def test_bridge_resume_exact_with_the_fixes(checked):
    _assert_exact_everywhere(checked["on"])
    # The run with the fixes that never resumes (it saves and trains on) is the release's own, bit for bit.
    assert checked["on"]["unchanged"]["verdict"] == "exact", resume_fail_text(checked["on"]["unchanged"])


def test_bridge_resume_exact_without_the_fixes(checked):
    """Bridge's own torch_dist RNG entry is per rank under EP: nothing here needs a fix (EP rank 1
    included, its expert-parallel stream compared), so the check declares none."""
    assert CFG.needs == () and checked["needed_here"] == [], checked["needed_here"]
    _assert_exact_everywhere(checked["off"])
