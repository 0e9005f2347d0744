"""The resume check through ms-swift 4.6.0's own ``save_mcore_checkpoint`` / ``load_mcore_checkpoint``.

Configuration ``moe-ep2-ms-swift`` (mcore_ckpt_fixes/resume/configs.py, job in
mcore_ckpt_fixes/resume/ms_swift.py): the MoE GPT of ``moe-ep2`` (EP=2 on 2 forked gloo ranks, one
local expert per EP rank, Megatron's DDP and distributed optimizer on the FusedAdam stand-in,
dropout, router noise in the tracker's expert-parallel stream), set up by ms-swift's
``initialize_megatron`` (parallel state, ``mcore_bridge.set_random_seed``), run B saving with
``save_mcore_checkpoint`` in ``torch_dist`` (model, optimizer, scheduler, ms-swift's RNG entry) and
run C (new processes) loading with ``load_mcore_checkpoint``, which restores all of it. A and C
compared bit for bit per rank.

With the fixes: exact on both ranks (rng-under-ep's ms-swift target gives every rank its own RNG
entry). Without them: ms-swift's ``_get_rng_state`` keys the ``torch_dist`` RNG entry by (pp, tp)
with the data-parallel rank as replica id, so EP rank 1 resumes on EP rank 0's streams: its first
resumed step differs and its expert-parallel stream ends elsewhere, while EP rank 0's first resumed
step is exact (the next differs: gradients are reduced across the EP ranks).

The check runs in a subprocess: ms-swift's import patches torch's DCP reader process-wide, so it is
imported there (once, before the worlds fork) and never in this process, as in test_ms_swift.py.
Stand-ins: those of mcore_ckpt_fixes/testing/gpt_job.py, and Transformer Engine around ``mcore_bridge``'s
import (mcore_ckpt_fixes/resume/ms_swift.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
from importlib import metadata

import pytest

from conftest import run_py, resume_fail_text
from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import by_name

FRAMEWORK = "ms-swift"
CFG = by_name("moe-ep2-ms-swift")
EXPERT_STREAM = "rng:tracker:expert-parallel-rng"

# The ranks print to stdout (Megatron's buffer layout): the report goes to a file.
_CHECK = """
import json
from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import by_name
resume.prepare()
out = resume.check(by_name("moe-ep2-ms-swift"))
with open({report!r}, "w") as f:
    json.dump(out, f)
"""


def _installed():
    """ms-swift and mcore-bridge present (found without importing them: see the module docstring)."""
    try:
        metadata.version(FRAMEWORK)
        return importlib.util.find_spec("mcore_bridge") is not None and importlib.util.find_spec("swift") is not None
    except (metadata.PackageNotFoundError, ImportError, ValueError):
        return False


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The check once for the module (A, then B and C with the fixes on and with every fix off), in a
    subprocess that imports ms-swift."""
    if not _installed():
        if os.environ.get("MCORE_CKPT_FIXES_FRAMEWORK") == FRAMEWORK:
            pytest.fail(f"{FRAMEWORK} is this line's framework but is not installed (tools/envs.sh fw-{FRAMEWORK})")
        pytest.skip(f"{FRAMEWORK} not installed here; run tools/test.sh fw-{FRAMEWORK}")
    report = str(tmp_path_factory.mktemp("ms-swift-resume") / "report.json")
    proc = run_py(_CHECK.format(report=report), timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
    with open(report) as f:
        out = json.load(f)
    assert "not_applicable" not in out, out["not_applicable"]  # installed, so it must build here
    return out


def test_ms_swift_resume_exact_with_the_fixes(checked):
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
        assert any(":state" in n and n.endswith(":exp_avg_sq") for n in names), sorted(names)
        assert not [w for w in r["load_warnings"] if "MegatronPatchWarning" in w], r["load_warnings"]


def test_ms_swift_resume_without_the_fixes_ep_rank_1_resumes_on_rank_0s_streams(checked):
    assert checked["needed_here"] == ["rng-under-ep"], checked["needed_here"]
    off = checked["off"]
    assert off["verdict"] == "inexact", resume_fail_text(off)
    first = resume.RESUME_AT + 1
    ep0, ep1 = sorted(off["ranks"], key=lambda r: r["ep"])
    assert (ep0["ep"], ep1["ep"]) == (0, 1), off["ranks"]
    assert ep1["first_step"] == first and EXPERT_STREAM in ep1["differ_all"], resume_fail_text(off)
    assert ep0["first_step"] == first + 1 and EXPERT_STREAM not in ep0["differ_all"], resume_fail_text(off)
