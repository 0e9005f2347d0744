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


def hangs(rank, world_size):
    time.sleep(3600)
