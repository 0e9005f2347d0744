"""Tiny scenarios that exercise the launcher itself (not Megatron)."""

import os
import time

import torch
import torch.distributed as dist


def allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "fixes": os.environ.get("MCORE_CKPT_FIXES")}


def one_rank_fails_before_collective(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 broke before the barrier")
    dist.barrier()  # rank 0 would wait here forever
    return "unreachable"


def fills_a_large_buffer(rank, world_size):
    """A parallel CPU op (above torch's grain size): where it ran in the OpenMP pool the parent
    started, a forked rank waited here forever."""
    import torch

    return float(torch.zeros(5_000_000).add_(1).sum())


def hangs(rank, world_size):
    time.sleep(3600)


def argument_helps(rank, world_size):
    """Every argument's help text as ``megatron.training``'s parser builds it in this rank, and
    whether this rank looked its config classes' help texts up (testing/_arg_docs.py)."""
    import argparse

    from megatron.training.argument_utils import ArgumentGroupFactory
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser())
    looked_up = ArgumentGroupFactory._get_field_docstrings.__module__ == "mcore_ckpt_fixes.testing._arg_docs"
    return {"helps": {a.dest: a.help for a in parser._actions}, "looked_up": looked_up}


def killed_by_a_signal(rank, world_size):
    """Rank 1 ends without a result and without a Python error (as a segmentation fault ends it)."""
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def distributed_optimizer_steps(rank, world_size, through_host):
    """Two steps of Megatron's distributed optimizer (its gradient reduce-scatter and parameter
    all-gather inside ``_coalescing_manager``); with ``through_host``, every such collective's tensors
    go through host copies and the coalescing blocks run eagerly (testing/_gloo_cuda.py, as on a
    GPU host's gloo world, here for CPU tensors). This rank's parameters, main shards and moments,
    and which of Megatron's names the shim holds."""
    from megatron.core.distributed import param_and_grad_buffer

    from mcore_ckpt_fixes.testing import _gloo_cuda
    from mcore_ckpt_fixes.testing import dist_optimizer as dopt

    if through_host:
        import sys

        class NoName:  # filed in sys.modules without a __name__, as Cython's shadow module files one
            pass

        sys.modules["megatron.core._filed_without_a_name"] = NoName()
        _gloo_cuda.staged = lambda tensor: True
        _gloo_cuda.install()
    with dopt.world("cpu"):
        model, opt = dopt.build(seed=7)
        for index in range(2):
            dopt.step(model, opt, index)
        state = dopt.local_state(model, opt)
    held = {
        name: getattr(getattr(param_and_grad_buffer, name, None), "through_host", False)
        for name in ("_coalescing_manager", "dist_all_gather_func", "dist_reduce_scatter_func")
    }
    return {"state": state, "held": held}
