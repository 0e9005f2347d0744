"""persistent-worker-failure: both halves on every affected CI line.

World 2 (gloo on CPU), Megatron-Core's AsyncCallsQueue with the persistent worker: rank 0's worker
dies during a save's write (``dies``) or preload (``dies_in_preload``), after a save where none does. See
mcore_ckpt_fixes/fixes/persistent_worker_failure/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.persistent_worker_failure import FIX, MODULE
from mcore_ckpt_fixes.fixes.persistent_worker_failure.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.persistent_worker_failure.checks.core"


@pytest.fixture(scope="module", params=["dies", "dies_in_preload"])
def dies(request, tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:{request.param}", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_every_rank_still_waits_at_the_deadline(dies, mcore_version):
    for rank, r in enumerate(dies[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("finalize", sc.HANG.error), (rank, r["phase"], r.get("traceback"))
    assert sc.HANG.seen_in(dies[False])


def test_patched_every_rank_raises_and_the_earlier_save_loads_exactly(dies):
    expected = [sc.DIED_HERE, sc.DIED_ELSEWHERE]  # rank 0's worker died; rank 1's finished
    for rank, r in enumerate(dies[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["worker_died"] == expected[rank], (rank, r["worker_died"])
        assert r["n_tensors"] == 2 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


def test_where_no_worker_dies_both_halves_save_the_same_bits(dies):
    for patched in (False, True):
        for rank, r in enumerate(dies[patched]):
            assert r["finalized"] == 1 and r["max_delta"].get("shard") == 0.0, (patched, rank, r["max_delta"])
    assert [r["digests"]["shard"] for r in dies[False]] == [r["digests"]["shard"] for r in dies[True]]
