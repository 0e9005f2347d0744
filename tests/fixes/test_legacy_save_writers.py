"""legacy-save-writers: both halves on 0.17.1, one warm world each; not needed on 0.18.2 and 0.19.2,
not applicable on 0.16.1 (no megatron.training).

World 2 laid out TP=2, EP=1, expert TP=1 (expert-DP size 2: TP rank 1 has expert-DP rank 1), gloo on
CPU, the resume check's MoE GPT (mcore_ckpt_fixes/testing/gpt_job.py, configuration moe-tp2-etp1-legacy,
with its CPU stand-ins), saved and loaded by megatron.training's own save_checkpoint /
load_checkpoint in the legacy torch format. See mcore_ckpt_fixes/fixes/legacy_save_writers/checks/core.py.
"""

import threading
import types

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.legacy_save_writers import FIX
from mcore_ckpt_fixes.fixes.legacy_save_writers.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.legacy_save_writers.checks.core"
MODULE = "megatron.training.checkpointing"
FILE = "iter_0000001/mp_rank_0{}/model_optim_rng.pt"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_never_writes_tp_rank_1s_file(worlds, mcore_version):
    layouts = [r["layout"] for r in worlds[False]]
    assert layouts == [{"tp": 0, "expert_dp": 0}, {"tp": 1, "expert_dp": 1}], layouts
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.UNWRITTEN.phase, sc.UNWRITTEN.error), (rank, r.get("traceback"))
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_every_file_written_and_loaded_exactly(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["max_delta"] and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        # Every file once, by one rank: TP=2 two names, one each; DP=2 one name, one writer.
        assert r["writers"] == {"tp2": {FILE.format(0): [0], FILE.format(1): [1]}, "dp2": {FILE.format(0): [0]}}, r[
            "writers"
        ]


def test_the_view_answers_only_inside_a_save_in_its_own_context():
    """The module's ``mpu`` is the view from apply on (recorded, reverted with the fix): outside a
    save, and in any other thread during one, it is ``parallel_state``'s own answers."""
    from mcore_ckpt_fixes.fixes.legacy_save_writers.runtime import core

    real = types.SimpleNamespace(get_expert_data_parallel_rank=lambda: 0, get_data_parallel_rank=lambda: 0)
    view = core.ElectedWriterView(real)
    seen = {"before": view.get_expert_data_parallel_rank()}
    token = core.ELECTED_WRITER_ANSWER.set(1)  # what save_checkpoint sets on a rank not elected to write its file
    try:
        seen["saving"] = view.get_expert_data_parallel_rank()
        seen["other"] = view.get_data_parallel_rank()
        t = threading.Thread(target=lambda: seen.update(thread=view.get_expert_data_parallel_rank()))
        t.start()
        t.join()
    finally:
        core.ELECTED_WRITER_ANSWER.reset(token)
    seen["after"] = view.get_expert_data_parallel_rank()
    assert seen == {"before": 0, "saving": 1, "other": 0, "thread": 0, "after": 0}, seen
