"""The collectives of a gloo world on a GPU host (testing/_gloo_cuda.py): Megatron's distributed
optimizer trains to the same bits when its all-gathers and reduce-scatters go through host copies
and its coalescing blocks run eagerly. On this CPU host the shim is made to take CPU tensors too
(on a GPU host it takes CUDA tensors only), so both paths run here."""

import pytest
import torch

from mcore_ckpt_fixes.testing.launcher import run_world, values

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)


def _steps(through_host):
    return values(
        run_world("world_scenarios:distributed_optimizer_steps", 2, {"through_host": through_host}, timeout=120)
    )


def test_the_distributed_optimizer_trains_to_the_same_bits_through_the_host():
    direct, staged = _steps(False), _steps(True)
    for rank, (a, b) in enumerate(zip(direct, staged)):
        assert set(b["held"].values()) == {True}, b["held"]  # Megatron's own names hold the shim's
        assert not any(a["held"].values()), a["held"]
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for key, value in a["state"].items():
            assert torch.equal(value, b["state"][key]), (rank, key)
