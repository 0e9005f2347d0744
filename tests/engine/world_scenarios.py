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
