"""async-save-pinned-buffers: both halves on every affected CI line (see checks/core.py).

World 1 (gloo on CPU): an asynchronous torch_dist save through TemporalAsyncCaller's forked writer,
the trainer's next device-to-host copies made before the writer writes. Pinned host memory is stood
in for on this CPU host (checks/core.py: PinnedCopies, shared memory pooled as torch's caching host
allocator pools pinned blocks); tests/gpu runs the same round trip with torch's own pinned copies.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.async_save_pinned_buffers import FIX, MODULE
from mcore_ckpt_fixes.fixes.async_save_pinned_buffers.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.async_save_pinned_buffers.checks.core import SHAPES

CORE = "mcore_ckpt_fixes.fixes.async_save_pinned_buffers.checks.core"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(
        FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version, nproc=1
    )


def test_unpatched_the_checkpoint_holds_the_trainers_next_copies(worlds, mcore_version):
    bug = sc.SCENARIOS[0].bug_for(mcore_version)
    (r,) = worlds[False]
    assert set(r["fix_state"].values()) == {"disabled"}, r["fix_state"]
    assert (r["phase"], r["error"]) == (bug.phase, bug.error), (r["phase"], r["error"], r.get("traceback"))


def test_patched_the_checkpoint_holds_the_step_it_saved(worlds):
    (r,) = worlds[True]
    assert r["fix_state"][MODULE] == "applied", r["fix_state"]
    assert r["error"] is None, (r["phase"], r["error"], r.get("traceback"))
    assert set(r["max_delta"]) == set(SHAPES) and set(r["max_delta"].values()) == {0.0}, r["max_delta"]


def test_where_the_release_keeps_the_copies_both_halves_hold_the_step_saved(tmp_path_factory, mcore_version):
    """0.17 on keeps the staged copies itself: the fix is not needed, and the outcome is the same
    with it off and on (the release's own code runs)."""
    halves = both_halves(
        FIX,
        f"{CORE}:round_trip",
        tmp_path_factory=tmp_path_factory,
        mcore_version=mcore_version,
        nproc=1,
        affected=False,
    )
    for patched, (r,) in halves.items():
        assert r["error"] is None, (patched, r["phase"], r["error"], r.get("traceback"))
        assert set(r["max_delta"]) == set(SHAPES) and set(r["max_delta"].values()) == {0.0}, (patched, r)
