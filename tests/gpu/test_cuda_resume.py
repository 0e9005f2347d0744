"""The resume check on this machine's GPU (``pytest -m gpu``): the same configurations as on CPU, with
no CPU shim (the ranks run on CUDA over gloo, several may share one GPU). Megatron's FusedAdam path is
the installed Apex's or Transformer Engine's; on a host with neither, the FusedAdam stand-in on CUDA
tensors (configurations without it take torch's Adam); each record names the path (``optimizer``).
With the fixes every configuration resumes bit for bit; record the device and the result in
docs/validation.md (GPU runs).

``MCORE_CKPT_FIXES_GPU_TEST_DEVICE=cpu`` rehearses it on CPU ranks (tests/cuda_round_trip_judge.py).

Deselected by default (pyproject addopts ``-m 'not gpu'``): CI has no GPU.
"""

import pytest
import resume_expect as expect
from cuda_round_trip_judge import device

from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import CONFIGS

pytestmark = pytest.mark.gpu
# Pipeline layouts are left to the CPU run until they have been tried on a GPU: their p2p sends run
# on gloo, which has never been tried on CUDA tensors here, and a rank stuck in one holds the GPU
# check's budget for the world's whole timeout (docs/validation.md, GPU runs).
ON_GPU = [c for c in CONFIGS if c.pp == 1]


@pytest.mark.parametrize("cfg", ON_GPU, ids=[c.name for c in ON_GPU])
def test_cuda_resume_exact_with_the_fixes(cfg, capsys, mcore_version):
    import torch

    if device() == "cuda" and not torch.cuda.is_available():
        pytest.fail("pytest -m gpu was asked for, but CUDA is not available to this torch")
    why = resume.not_applicable()
    if why:
        pytest.skip(f"not applicable: {why}")
    resume.prepare()
    out = resume.check(cfg, device=device())
    if "not_applicable" in out:  # e.g. the Bridge configuration where Megatron-Bridge is not installed
        pytest.skip(f"{cfg.name} not applicable: {out['not_applicable']}")
    from test_cuda_round_trips import record

    record({"resume": cfg.name, "release": str(mcore_version), "device": device(), "on": out["on"]["verdict"],
            "unchanged": out["on"].get("unchanged", {}).get("verdict"), "off": out["off"]["verdict"],
            "off_error": out["off"].get("error"), "needed_here": out.get("needed_here"),
            "optimizer": out.get("optimizer")})  # fmt: skip
    where = torch.cuda.get_device_name(0) if device() == "cuda" else "cpu (rehearsal)"
    with capsys.disabled():
        print(
            f"\n{cfg.name} on {where} ({out.get('optimizer')}): "
            f"on {out['on']['verdict']}, unchanged {out['on'].get('unchanged', {}).get('verdict')}, "
            f"off {out['off']['verdict']}"
        )
    # The same expectations as the CPU run (tests/resume_expect.py): with the fixes, exact (or the
    # release's own resume, for options not meant to be exact) and a run that never resumes is the
    # release's own bit for bit; without them, each needed fix's bug where the CPU run shows it.
    expect.assert_unchanged_by_the_fixes(cfg, out)
    if cfg.expect == resume.AS_RELEASE:
        expect.assert_as_release_with_the_fixes(cfg, out)
        expect.assert_release_resumes_as_each_option_says(cfg, out)
        return
    expect.assert_exact_with_the_fixes(cfg, out)
    expect.assert_without_the_fixes(cfg, out)
