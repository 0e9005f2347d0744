"""Every registered scenario written for CUDA, on this machine's GPUs (``pytest -m gpu``).

Both halves, as on CPU: with the fix off the documented bug shows on a release that needs the fix
(the round trip is exact on one that does not); with it on, every rank is exact and its tensors
were on a GPU. No CPU shims: the worker installs none where CUDA is available, so Megatron's real
``torch.cuda`` calls run.

The scenarios of a fix that name one ``batch`` run together, one world per half (a world is most of
a scenario's cost); the others one world per half each.

Backend: NCCL when there is a GPU per rank. NCCL refuses two ranks on one device, so on a
single-GPU machine the ranks share GPU 0 over gloo (CUDA tensors, real CUDA calls; the collectives
are gloo's). Which one ran is printed; the runs are listed in docs/validation.md (GPU runs).

What each world is held to is tests/cuda_round_trip_judge.py's, checked on CPU in every line by
tests/test_gpu_collection.py; ``MCORE_CKPT_FIXES_GPU_TEST_DEVICE=cpu`` rehearses this whole module on
CPU ranks (the same worlds and judgement) before a GPU host's time is spent on it.

Deselected by default (pyproject addopts ``-m 'not gpu'``): CI has no GPU. tests/test_gpu_collection.py
collects this module (and ``test_selftest_cuda``) on every line, so their parametrisation and fixtures
are checked where no GPU is.
"""

import json
import os
import tempfile

import pytest
from cuda_round_trip_judge import assert_round_trip, bug_off, device, off_env_of, world_of

from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.testing.launcher import WorldError, cuda_method, run_world, values
from mcore_ckpt_fixes.testing import all_scenarios, resolve

pytestmark = pytest.mark.gpu

CUDA_SCENARIOS = [s for s in all_scenarios() if "cuda" in s.devices and ENGINE.discover()[s.fix_id].implemented]


def _backend(nproc):
    import torch

    if device() == "cpu":  # a rehearsal of the check on CPU ranks (cuda_round_trip_judge)
        return "gloo"
    if not torch.cuda.is_available():
        pytest.fail("pytest -m gpu was asked for, but CUDA is not available to this torch")
    return "nccl" if torch.cuda.device_count() >= nproc else "gloo"


def record(row):
    """One line of tools/gpu_check.sh's machine-readable results (``MCORE_CKPT_FIXES_GPU_RESULTS``)."""
    path = os.environ.get("MCORE_CKPT_FIXES_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def _together(scenario):
    """The CUDA scenarios that run in ``scenario``'s worlds: every one of its fix naming the same
    ``batch`` that this release can run, or ``scenario`` alone."""
    if scenario.batch is None:
        return [scenario]
    return [s for s in CUDA_SCENARIOS if (s.fix_id, s.batch) == (scenario.fix_id, scenario.batch) and not s.absent()]


@pytest.fixture(scope="module")
def halves():
    """``{scenario id: {patched: [each rank's result]}}``, filled one world per half and batch."""
    return {}


def _run_halves(scenario, done):
    if scenario.id not in done:
        try:
            _start(scenario, done)
        except WorldError as exc:  # the batch's other scenarios fail with it, without a second world
            for s in _together(scenario):
                done[s.id] = exc
    if isinstance(done[scenario.id], WorldError):
        pytest.fail(f"a world of {scenario.batch or scenario.func} failed:\n{done[scenario.id]}")
    return done[scenario.id]


def _start(scenario, done):
    together = _together(scenario)
    for s in together:
        if s.prepare:
            resolve(s.prepare)()
    nproc, timeout = world_of(together)
    backend = _backend(nproc)
    for patched in (False, True):
        env = {} if patched else off_env_of(together)
        kwargs = {"ckpt_dir": tempfile.mkdtemp(), "patched": patched, "device": device()}
        if scenario.batch is not None:
            kwargs["names"] = [s.name for s in together]
        ranks = values(
            run_world(
                scenario.batch or scenario.func,
                nproc,
                kwargs,
                backend=backend,
                # fork where a forked rank can still use the GPU, else spawn; a rehearsal: as on CPU
                method=cuda_method() if device() == "cuda" else None,
                env=env,
                timeout=timeout,
            )
        )
        for s in together:
            per_rank = [r[s.name] for r in ranks] if scenario.batch is not None else ranks
            done.setdefault(s.id, {"backend": backend})[patched] = per_rank


@pytest.mark.parametrize("scenario", CUDA_SCENARIOS, ids=[s.id for s in CUDA_SCENARIOS])
def test_cuda_round_trip(scenario, mcore_version, halves, capsys):
    absent = scenario.absent()
    if absent:
        pytest.skip(f"not applicable to Megatron-Core {mcore_version}: {absent}")
    affected = mcore_version in ENGINE.discover()[scenario.fix_id].specifiers
    bug = bug_off(scenario, mcore_version, affected)
    run = _run_halves(scenario, halves)
    backend, off, on = run["backend"], run[False], run[True]
    record(
        {
            "fix": scenario.fix_id,
            "scenario": scenario.name,
            "release": str(mcore_version),
            "backend": backend,
            "device": device(),
            "fix_needed": affected,
            "bug_shown_off": bug.describe() if bug is not None else None,
            "off": [{"phase": r["phase"], "error": r["error"]} for r in off],
            "on": [
                {
                    "error": r["error"],
                    "max_delta": max(r["max_delta"].values(), default=None),
                    "device": r.get("device"),
                }
                for r in on
            ],
        }
    )
    with capsys.disabled():
        print(
            f"\n{scenario.id}: backend {backend}, devices {[r.get('device') for r in on]}, "
            f"fix off: {[r['error'] for r in off]}, fix on max delta: {[max(r['max_delta'].values(), default=None) for r in on]}"
        )
    assert_round_trip(bug, off, on, device())
