"""Catalogued bugs that no fix covers and that only a GPU can show (``pytest -m gpu``): the release's
own outcome, asserted against the catalogue entry, so that a GPU run either confirms the entry's
reading of the code or says where it is wrong.

``mfsdp-reload-model-params-not-implemented``: Megatron-FSDP (its buffers are CUDA-only), a bf16
GPT saved in ``fsdp_dtensor`` and loaded with ``--no-load-optim`` (one rank on one GPU, NCCL; see
mcore_ckpt_fixes/testing/known_bug_repros.py). In the entry's releases the load stops with the
documented ``NotImplementedError``; before them it completes.

Deselected by default (pyproject addopts ``-m 'not gpu'``): CI has no GPU. tests/test_gpu_collection.py
collects it and runs its code on the CPU up to Megatron-FSDP's CUDA buffers.
"""

import tempfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cuda_round_trip_judge import device

from mcore_ckpt_fixes import known_bugs
from mcore_ckpt_fixes.testing.launcher import cuda_method, run_world, values

pytestmark = pytest.mark.gpu

MFSDP_REPRO = "mcore_ckpt_fixes.testing.known_bug_repros:mfsdp_no_load_optim"
MFSDP_ERROR = "NotImplementedError: Megatron-FSDP does not implement a model-to-main parameter update."


def test_mfsdp_no_load_optim_as_catalogued(mcore_version, capsys):
    import torch

    if device() == "cpu":
        pytest.skip("a CPU rehearsal: tests/test_gpu_collection.py runs this reproduction up to its first CUDA call")
    if not torch.cuda.is_available():
        pytest.fail("pytest -m gpu was asked for, but CUDA is not available to this torch")
    if mcore_version < Version("0.17.0"):
        pytest.skip("megatron.training ships in the wheel from 0.17.0")
    (bug,) = [b for b in known_bugs.load() if b["id"] == "mfsdp-reload-model-params-not-implemented"]
    (r,) = values(
        run_world(
            MFSDP_REPRO,
            1,
            {"ckpt_dir": tempfile.mkdtemp(), "device": "cuda"},
            backend="nccl",
            method=cuda_method(),
            timeout=300,
        )
    )
    from test_cuda_round_trips import record

    affected = mcore_version in SpecifierSet(bug["affected"], prereleases=True)
    record({"known_bug": bug["id"], "release": str(mcore_version), "affected": affected, "phase": r["phase"],
            "error": r["error"], "device": r.get("device"), "max_delta": r["max_delta"]})  # fmt: skip
    with capsys.disabled():
        print(f"\n{bug['id']} on {r.get('device')}: phase {r['phase']}, error {r['error']}, deltas {r['max_delta']}")
    assert str(r.get("device", "")).startswith("cuda"), (r["phase"], r["error"], r.get("traceback"))
    if affected:
        assert (r["phase"], r["error"]) == ("load", MFSDP_ERROR), (r["phase"], r["error"], r.get("traceback"))
    else:
        assert r["error"] is None, (r["phase"], r["error"], r.get("traceback"))
