"""The round-trip launcher: results per rank, tracebacks back to the test, deadlines kill hangs."""

import time

import pytest

from mcore_ckpt_fixes.testing.launcher import WorldError, run_world, values

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)


def test_results_from_every_rank_and_env_applied():
    res = values(run_world("world_scenarios:allreduce_rank", 2, env={"MCORE_CKPT_FIXES": "off"}, timeout=60))
    assert [r["rank"] for r in res] == [0, 1]
    assert {r["sum"] for r in res} == {1.0}
    assert {r["fixes"] for r in res} == {"off"}


def test_failing_rank_does_not_hang_the_world():
    start = time.monotonic()
    results = run_world("world_scenarios:one_rank_fails_before_collective", 2, timeout=20)
    assert time.monotonic() - start < 40
    assert not results[1].ok and "rank 1 broke before the barrier" in results[1].error
    assert not results[0].ok  # rank 0 never gets past the barrier: gloo errors out or the deadline kills it
    with pytest.raises(WorldError, match="rank 1 broke"):
        values(results)


def test_forked_ranks_run_parallel_ops_after_the_parent_did():
    """pytest's process runs torch ops between worlds; a forked rank then must not wait for the
    parent's OpenMP threads (it hung in a DDP buffer's torch.zeros before ranks ran on one thread)."""
    import torch

    assert float((torch.ones(4_000_000) * 2).sum()) == 8_000_000.0  # the parent's pool is running
    assert values(run_world("world_scenarios:fills_a_large_buffer", 2, timeout=30)) == [5_000_000.0] * 2


def test_hang_is_killed_at_the_deadline():
    start = time.monotonic()
    results = run_world("world_scenarios:hangs", 2, timeout=5)
    assert time.monotonic() - start < 30
    assert all(not r.ok and "did not finish within 5 s" in r.error for r in results)
    # Each hung rank's stack, dumped just before the deadline, says where it waited.
    assert all("where it waited" in r.error and "in hangs" in r.error for r in results), results[0].error


def test_spawn_method_works_too():
    res = values(
        run_world(
            "world_scenarios:allreduce_rank",
            2,
            method="spawn",
            timeout=120,
            env={
                "PYTHONPATH": __import__("os").path.dirname(__file__)
                + ":"
                + __import__("os").environ.get("PYTHONPATH", "")
            },
        )
    )
    assert {r["sum"] for r in res} == {1.0}


def test_a_taken_rendezvous_port_starts_the_world_again(monkeypatch):
    """Another process holds the port free_port() handed out (rank 0 cannot listen: EADDRINUSE; rank
    1 would wait on the stranger's socket until the deadline, past pytest's own timeout for a long
    world): the other ranks are stopped as soon as rank 0 says so, the world starts once more on
    another port, and its results are the scenario's."""
    import socket

    from mcore_ckpt_fixes.testing import launcher

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    ports = [taken.getsockname()[1]]
    real = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: ports.pop(0) if ports else real())
    start = time.monotonic()
    try:
        res = values(run_world("world_scenarios:allreduce_rank", 2, timeout=300))
    finally:
        taken.close()
    assert not ports, "the taken port was never handed out"
    assert time.monotonic() - start < 120, "rank 1 was left waiting for the world's deadline"
    assert res == values(run_world("world_scenarios:allreduce_rank", 2, timeout=60))


def test_cuda_worlds_fork_only_where_a_forked_child_can_use_the_gpu(monkeypatch):
    """``cuda_method``: ``fork`` only if a forked child could put a tensor on the GPU (there is none
    here, so the child fails and the answer is ``spawn``), and ``spawn`` without asking once this
    process initialised CUDA (a fork would inherit unusable CUDA state)."""
    import torch

    from mcore_ckpt_fixes.testing import launcher

    assert not torch.cuda.is_available()
    assert launcher.cuda_method() == "spawn"
    forks = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(launcher.os, "fork", lambda: forks.append(1) or 0)
    assert launcher.cuda_method() == "spawn" and not forks


def test_a_rank_ended_by_a_signal_is_named_with_it():
    """A rank that dies without a Python error (a segmentation fault in a collective, say) leaves no
    result: the error says which signal ended it, not only that there was none."""
    results = run_world("world_scenarios:killed_by_a_signal", 2, timeout=30)
    assert not results[1].ok
    assert "rank 1 exited without a result (killed by SIGKILL" in results[1].error, results[1].error
