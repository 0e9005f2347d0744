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
