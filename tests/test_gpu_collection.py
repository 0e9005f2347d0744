"""The ``gpu``-marked tests, checked on a host without a GPU: they run only where CUDA is (``pytest -m
gpu``), so their structure is checked here, where every line runs, that they cannot rot unseen.

Collected as ``pytest -m gpu`` collects them (a child pytest: ``--collect-only`` imports the modules and
parametrises, ``--setup-plan`` resolves every fixture they ask for without running one), each
registered scenario written for CUDA once, under the id the CPU round trips and ``selftest`` use.
"""

import inspect
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from conftest import ROOT
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.fixes import ORDER
from mcore_ckpt_fixes.testing import for_fix, resolve

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)

GPU_ROUND_TRIPS = "tests/gpu/test_cuda_round_trips.py::test_cuda_round_trip"
SELFTEST_CUDA = "tests/cli/test_selftest.py::test_selftest_cuda"
GPU_RESUME = "tests/gpu/test_cuda_resume.py::test_cuda_resume_exact_with_the_fixes"
GPU_KNOWN_BUGS = ["tests/gpu/test_cuda_known_bugs.py::test_mfsdp_no_load_optim_as_catalogued"]


def _pytest_gpu(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", *args, "tests/gpu", SELFTEST_CUDA],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    return proc.stdout


def _cuda_scenarios():
    """What the CPU round trips register for CUDA too, in selftest's order (fixes in ``status`` order)."""
    fixes = ENGINE.discover()
    return [s for fix_id in ORDER if fixes[fix_id].implemented for s in for_fix(fix_id) if "cuda" in s.devices]


def test_gpu_tests_collect_as_on_cuda():
    scenarios = _cuda_scenarios()
    assert scenarios, "no registered scenario is written for CUDA: tests/gpu would test nothing"
    collected = [ln for ln in _pytest_gpu("--collect-only", "-q").splitlines() if "::" in ln]
    from mcore_ckpt_fixes.resume.configs import CONFIGS

    # Every configuration the CPU check runs, but the pipeline layouts (not yet tried on a GPU).
    resume = [f"{GPU_RESUME}[{c.name}]" for c in CONFIGS if c.pp == 1]
    round_trips = [f"{GPU_ROUND_TRIPS}[{s.id}]" for s in scenarios]
    assert collected == GPU_KNOWN_BUGS + resume + round_trips + [SELFTEST_CUDA], collected


def test_gpu_tests_fixtures_resolve():
    plan = _pytest_gpu("--setup-plan")
    assert "fixture '" not in plan and "error" not in plan.lower(), plan
    for s in _cuda_scenarios():
        assert f"{GPU_ROUND_TRIPS}[{s.id}]" in plan, plan


def test_cuda_scenarios_take_a_device():
    """tests/gpu calls each scenario with ``device="cuda"`` (and its ``prepare`` first): both resolve,
    and the scenario has the parameter."""
    for s in _cuda_scenarios():
        params = inspect.signature(resolve(s.func)).parameters
        assert {"rank", "world_size", "ckpt_dir", "patched", "device"} <= set(params), (s.id, list(params))
        if s.prepare:
            assert callable(resolve(s.prepare)), s.prepare
        if s.batch:  # several of the fix's scenarios in one world: by name, on a device
            params = inspect.signature(resolve(s.batch)).parameters
            assert {"rank", "world_size", "ckpt_dir", "patched", "device", "names"} <= set(params), (s.id, s.batch)


def test_known_bug_reproduction_runs_up_to_the_gpu(tmp_path, mcore_version):
    """tests/gpu/test_cuda_known_bugs.py's Megatron-FSDP reproduction on this CPU host: Megatron-LM's
    arguments (``--use-megatron-fsdp``, ``fsdp_dtensor``) pass ``validate_args`` and ``get_model``
    builds the GPT; the first thing that stops it is a CUDA call of ``get_model``'s Megatron-FSDP
    wrapping (before it, the CPU shims of the test worker answer Megatron's ``.cuda()``)."""
    from mcore_ckpt_fixes.testing.launcher import run_world, values

    if mcore_version < Version("0.17.0"):
        pytest.skip("megatron.training ships in the wheel from 0.17.0")
    (r,) = values(
        run_world(
            "mcore_ckpt_fixes.testing.known_bug_repros:mfsdp_no_load_optim",
            1,
            {"ckpt_dir": str(tmp_path), "device": "cpu"},
            timeout=240,
        )
    )
    # Where in torch.cuda it stops, and its words, depend on the host (no driver, an old one) and
    # the release: in torch.cuda (0.17), or where 0.18's Megatron-FSDP adapter names its device
    # `cuda:{torch.cuda.current_device()}`, which the CPU shims answer with the CPU.
    assert r["phase"] == "build", (r["phase"], r["error"], r.get("traceback"))
    tb = r["traceback"]
    stopped_in_fsdp = "distributed/fsdp/mcore_fsdp_adapter.py" in tb and "Invalid device string: 'cuda:cpu'" in tb
    assert "in get_model" in tb and ("torch/cuda/" in tb or stopped_in_fsdp), tb


def test_fixes_kept_alongside_are_fixes():
    """A scenario's ``alongside`` (fixes on in its fix-off half, there and in selftest) names
    registered fixes other than its own; without any, the half turns every fix off."""
    from mcore_ckpt_fixes.testing import all_scenarios

    fixes = ENGINE.discover()
    for s in all_scenarios():
        assert all(f in fixes and f != s.fix_id for f in s.alongside), (s.id, s.alongside)
        assert s.off_env() == {"MCORE_CKPT_FIXES": ",".join(s.alongside) or "off"}, s.id


def test_a_batch_world_keeps_every_case_s_alongside_fixes_in_its_fix_off_half():
    """hybrid-optimizer-fresh-load's batch runs bf16 first and fp32 (which runs behind the fixes of
    the fp32 path) in one world: its fix-off half keeps fp32's fixes on, as fp32's own half does."""
    from cuda_round_trip_judge import off_env_of

    from mcore_ckpt_fixes.testing import for_fix

    batch = [s for s in for_fix("hybrid-optimizer-fresh-load") if s.batch]
    fp32 = next(s for s in batch if s.name == "fp32")
    assert batch[0].alongside == () and fp32.alongside, [(s.name, s.alongside) for s in batch]
    assert off_env_of(batch) == {"MCORE_CKPT_FIXES": ",".join(sorted(fp32.alongside))}
    assert off_env_of(batch[:1]) == batch[0].off_env() == {"MCORE_CKPT_FIXES": "off"}


def _rank(error=None, phase="compare", delta=0.0, device="cuda:0"):
    """One rank's result as a scenario reports it (what the judgement reads of it)."""
    return {"phase": phase, "error": error, "max_delta": {"w": delta}, "n_tensors": 1, "device": device}


def test_a_batch_world_is_as_large_as_its_largest_scenario(monkeypatch):
    """chained-optim's batch runs one_chunk (2 ranks) and two_chunks (4 ranks) in one world: 4 ranks,
    as its CPU test runs them (in a 2-rank world two_chunks has no pipeline stage to load). Its
    timeout is both scenarios', capped where the GPU check caps a world's."""
    from cuda_round_trip_judge import WORLD_TIMEOUT_VAR, world_of

    together = for_fix("chained-optim-main-params-split")
    assert sorted(s.nproc for s in together) == [2, 4]
    monkeypatch.delenv(WORLD_TIMEOUT_VAR, raising=False)
    assert world_of(together) == (4, sum(s.timeout for s in together))
    monkeypatch.setenv(WORLD_TIMEOUT_VAR, "150")
    assert world_of(together) == (4, 150.0)
    monkeypatch.setenv(WORLD_TIMEOUT_VAR, "soon")
    with pytest.raises(ValueError, match="MCORE_CKPT_FIXES_GPU_WORLD_TIMEOUT_S='soon': expected a number of seconds"):
        world_of(together)


def test_the_judgement_holds_each_half_to_the_release():
    """tests/gpu's judgement of one world, on results made up here: where the fix's release declares
    the scenario's bug, the fix-off half must show it; where the release covers the fix but the
    scenario round-trips exactly (param-group-identity's decoupled_lr from 0.19, the release matches
    such groups itself), the fix-off half must be exact; the fix-on half must be exact on every rank,
    on the device the check ran on."""
    from cuda_round_trip_judge import assert_round_trip, bug_off

    (decoupled,) = [s for s in for_fix("param-group-identity") if s.name == "decoupled_lr"]
    bug = decoupled.bug_for(Version("0.18.2"))
    shown = [_rank(bug.error, bug.phase), _rank(bug.error, bug.phase)]
    exact = [_rank(), _rank()]
    assert bug_off(decoupled, Version("0.19.2"), True) is None and bug_off(decoupled, Version("0.18.2"), False) is None
    assert_round_trip(bug_off(decoupled, Version("0.18.2"), True), shown, exact, "cuda")
    assert_round_trip(bug_off(decoupled, Version("0.19.2"), True), exact, exact, "cuda")
    failing = [
        (Version("0.18.2"), exact, exact, "cuda"),  # the declared bug did not show
        (Version("0.19.2"), shown, exact, "cuda"),  # an error where the release round-trips exactly
        (Version("0.19.2"), exact, [_rank(), _rank(delta=0.5)], "cuda"),  # the fix on, one rank off
        (Version("0.19.2"), exact, [_rank(), _rank(device="cpu")], "cuda"),  # a tensor not on the GPU
    ]
    for version, off, on, device in failing:
        with pytest.raises(AssertionError):
            assert_round_trip(bug_off(decoupled, version, True), off, on, device)


def test_the_check_device_is_cuda_or_a_cpu_rehearsal(monkeypatch):
    from cuda_round_trip_judge import DEVICE_VAR, device

    monkeypatch.delenv(DEVICE_VAR, raising=False)
    assert device() == "cuda"
    monkeypatch.setenv(DEVICE_VAR, "cpu")
    assert device() == "cpu"
    monkeypatch.setenv(DEVICE_VAR, "gpu")
    with pytest.raises(ValueError, match="MCORE_CKPT_FIXES_GPU_TEST_DEVICE='gpu': expected one of cuda, cpu"):
        device()


def test_gpu_runs_of_the_resume_jobs_take_deterministic_kernels(monkeypatch):
    """The resume check compares two runs bit for bit: in a GPU run its jobs (gpt_job.worker,
    resume/mimo.py) take torch's deterministic kernels and cuBLAS's deterministic workspace, as
    Megatron's --deterministic-mode does, and leave both as they were; a CPU run changes neither.
    (The flags only: what they do to CUDA kernels only a GPU run shows.)"""
    import torch

    from mcore_ckpt_fixes.testing.placement import CUBLAS_WORKSPACE, deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    with deterministic_kernels(on_gpu=False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with deterministic_kernels(on_gpu=True):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    # Both jobs' ranks: the GPT job's surroundings, which the MIMO job enters too.
    assert "deterministic_kernels(on_gpu=not on_cpu)" in inspect.getsource(
        resolve("mcore_ckpt_fixes.testing.gpt_job:worker")
    )
    assert "job.worker(cfg, device)" in inspect.getsource(resolve("mcore_ckpt_fixes.resume.mimo:run"))


_PARENT_IMPORTS = """
import torch

def refuse():
    raise RuntimeError("torch.cuda._lazy_init called in the parent")

torch.cuda._lazy_init = refuse  # what any CUDA call that initialises the GPU goes through
from mcore_ckpt_fixes.testing import all_scenarios, resolve
for s in all_scenarios():
    if "cuda" in s.devices and s.prepare and not s.absent():
        resolve(s.prepare)()
from mcore_ckpt_fixes.resume import check as resume
if not resume.not_applicable():
    resume.prepare()
print("no CUDA initialisation")
"""


def test_the_gpu_checks_parent_initialises_no_cuda():
    """The GPU check forks its CUDA worlds from the warm pytest process (launcher.cuda_method), which
    a child can only use where the parent never initialised CUDA: what the parent imports and
    prepares for every CUDA scenario and the resume check reaches no CUDA initialisation (device
    counts only, which NVML answers on a GPU host). A fresh interpreter, so that nothing this
    session imported hides an import-time call."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    proc = subprocess.run(
        [sys.executable, "-c", _PARENT_IMPORTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "no CUDA initialisation" in proc.stdout, proc.stderr[-3000:]
