"""forked-save-writers: both halves on every affected CI line (see checks/core.py).

World 2 (gloo on CPU), ``dist_checkpointing.save`` in the torch_dist format with two write buckets
per rank: a save and load, synchronous and asynchronous (Megatron's default async caller), then a
save where rank 0 cannot fork (``fork_fails``); a save whose first
bucket writer on rank 0 is killed by SIGSEGV (``write_dies``).
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.engine.flags import env_var_for
from mcore_ckpt_fixes.fixes.forked_save_writers import FIX, MODULE
from mcore_ckpt_fixes.fixes.forked_save_writers.checks import scenarios as sc
from mcore_ckpt_fixes.testing import resolve
from mcore_ckpt_fixes.testing.launcher import run_world

CORE = "mcore_ckpt_fixes.fixes.forked_save_writers.checks.core"
KEYS = {"a", "b"}


@pytest.fixture(scope="module")
def fork_fails(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:fork_fails", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


@pytest.fixture(scope="module")
def write_dies(tmp_path_factory, mcore_version):
    """Each rank's result (None where the rank's process ended without one) with the fix off and on."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    resolve(f"{CORE}:prepare")()
    out = {}
    for patched in (False, True):
        kwargs = {"ckpt_dir": str(tmp_path_factory.mktemp(f"dies{patched}")), "patched": patched}
        env = {} if patched else {env_var_for(FIX.id): "off"}
        out[patched] = run_world(f"{CORE}:write_dies", 2, kwargs, env=env, timeout=90.0)
    return out


def test_unpatched_a_rank_that_cannot_fork_fails_the_save(fork_fails, mcore_version):
    for rank, r in enumerate(fork_fails[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("fork_fails", sc.FORK_FAILED.error), (rank, r["phase"], r.get("traceback"))
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(fork_fails[False])


def test_patched_nothing_forks_and_both_saves_load_exactly(fork_fails):
    for rank, r in enumerate(fork_fails[True]):
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["writers"] == r["after/writers"] == "this process", (rank, r["writers"], r["after/writers"])
        assert r["async/writers"] == "1 other process(es)", (rank, r["async/writers"])  # the async caller's
        expected = {f"{p}{k}" for p in ("", "async/", "after/") for k in KEYS}
        assert set(r["max_delta"]) == expected and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


def test_where_nothing_fails_both_halves_save_the_same_bits(fork_fails):
    for rank, (off, on) in enumerate(zip(fork_fails[False], fork_fails[True])):
        # The release's own writer ran: a process forked per bucket.
        assert off["writers"] == off["async/writers"] == "2 other process(es)", (rank, off["writers"])
        saved = [f"{p}{k}" for p in ("", "async/") for k in KEYS]
        assert {k: off["max_delta"][k] for k in saved} == {k: 0.0 for k in saved}, (rank, off["max_delta"])
        assert {k: off["digests"][k] for k in saved} == {k: on["digests"][k] for k in saved}, rank


def test_unpatched_a_killed_writer_leaves_every_rank_waiting(write_dies):
    results = [r.value if r.ok else None for r in write_dies[False]]
    assert all(r is not None for r in results), [r.error for r in write_dies[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert (r["phase"], r["error"]) == ("save", sc.HANG.error), (rank, r["phase"], r["error"])
    assert sc.HANG.seen_in(results)


def test_patched_a_killed_writer_ends_its_rank_as_a_crash_does(write_dies):
    killed, other = write_dies[True]
    # The signal reached the saving process itself: rank 0 ended without a result, as a crashed
    # trainer does, which the launcher (torchrun) sees and ends the job for. Without the fix that
    # rank stays alive, waiting on a process that is gone, and no launcher learns of it.
    assert not killed.ok and "exited without a result" in killed.error, killed.error
    assert other.ok, other.error
    r = other.value
    assert r["fix_state"] == {MODULE: "applied"}, r["fix_state"]
    # The other rank waits for its lost peer in the save's barrier (gloo does not notice a dead peer
    # in that time), until the launcher stops it: the same as after any crash of a peer.
    assert (r["phase"], r["error"]) == ("save", sc.HANG.error), (r["phase"], r["error"])
