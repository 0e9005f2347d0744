"""What tests/gpu/test_cuda_round_trips.py holds a CUDA world to, as functions of the scenario, the
release and the ranks' results, so that tests/test_gpu_collection.py checks them on every line
where no GPU is (a judgement that only a GPU host ever ran could not be trusted to be right).

``device``: where the GPU check runs. ``cuda`` on a GPU host; ``cpu`` for a rehearsal of the whole
check on a host without one (``MCORE_CKPT_FIXES_GPU_TEST_DEVICE=cpu``, ``tools/gpu_check.sh``'s
``GPU_CHECK_DEVICE``): the same worlds, batches and judgement on CPU ranks, so that a device run
spends its time on what only a GPU can show.
"""

from __future__ import annotations

import os

DEVICE_VAR = "MCORE_CKPT_FIXES_GPU_TEST_DEVICE"
DEVICES = ("cuda", "cpu")


def device() -> str:
    """The device the GPU check runs on: ``cuda`` unless a CPU rehearsal was asked for."""
    value = os.environ.get(DEVICE_VAR, "cuda")
    if value not in DEVICES:
        raise ValueError(f"{DEVICE_VAR}={value!r}: expected one of {', '.join(DEVICES)}")
    return value


WORLD_TIMEOUT_VAR = "MCORE_CKPT_FIXES_GPU_WORLD_TIMEOUT_S"


def off_env_of(together) -> dict:
    """The fix-off half's environment of one world of ``together`` (one scenario, or one fix's batch):
    every fix off but those any of them runs alongside. A batch's cases share the world, so the case
    that needs fixes of an earlier bug on its path (hybrid-optimizer-fresh-load's ``fp32``) gets them
    whichever case is first."""
    from mcore_ckpt_fixes.engine.flags import GLOBAL_VAR

    alongside = sorted({fix for s in together for fix in s.alongside})
    return {GLOBAL_VAR: ",".join(alongside) or "off"}


def world_of(together) -> tuple:
    """(ranks, timeout) of the world that runs ``together`` (one scenario, or one fix's batch). A
    batch's world is as large as its largest scenario (chained-optim's ``two_chunks`` takes 4 ranks,
    ``one_chunk`` 2): every case runs on every rank of it, as the fix's own CPU test runs them. The
    timeout is the scenarios' together, at most ``MCORE_CKPT_FIXES_GPU_WORLD_TIMEOUT_S`` where that is
    set (tools/gpu_check.sh: a world that hangs on a GPU host must not use up its line's budget)."""
    timeout = sum(s.timeout for s in together)
    cap = os.environ.get(WORLD_TIMEOUT_VAR)
    if cap:
        try:
            timeout = min(timeout, float(cap))
        except ValueError:
            raise ValueError(f"{WORLD_TIMEOUT_VAR}={cap!r}: expected a number of seconds") from None
    return max(s.nproc for s in together), timeout


def bug_off(scenario, version, affected):
    """The bug the fix-off half must show, or None where it must be exact: a release the fix does not
    cover, or one it covers that declares no bug for this scenario (param-group-identity's
    ``decoupled_lr`` from 0.19, where the release itself matches such groups)."""
    return scenario.bug_for(version) if affected else None


def _exact(r) -> bool:
    return r["error"] is None and r.get("n_tensors", 1) > 0 and set(r["max_delta"].values()) == {0.0}


def assert_round_trip(bug, off, on, device):
    """Both halves of one scenario's world, each rank's result: with the fix off, ``bug`` (what
    :func:`bug_off` says it must show) or, where that is None, an exact round trip; with it on,
    every rank exact, its tensors on ``device``."""
    if bug is not None:
        assert bug.seen_in(off), [(r["phase"], r["error"]) for r in off]
    else:
        for r in off:
            assert _exact(r), (r["phase"], r["error"], r["max_delta"])
    for rank, r in enumerate(on):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert str(r.get("device", "")).startswith(device), (rank, r.get("device"), device)
