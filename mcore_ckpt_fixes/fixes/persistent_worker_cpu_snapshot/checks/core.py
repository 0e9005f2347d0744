"""persistent-worker-cpu-snapshot's round trip on 2 gloo ranks: ``dist_checkpointing.save`` with
``async_sharded_save=True`` (torch_dist, as ``megatron.training`` saves with ``--async-save``), its
request scheduled on Megatron-Core's ``AsyncCallsQueue(persistent=True)`` (the persistent worker),
then finalized with ``blocking=True``, then loaded back with ``dist_checkpointing.load``. The state:
CPU tensors, as the CPU-offloaded optimizer keeps its moments, one shard per rank.

Two saves in one world (the worker starts once). ``unchanged``: nothing touches the tensors before
the finalize: the release's own path, the same bits with the fix off and on (``unchanged/`` keys).
``next_step``: right after the save is scheduled the trainer updates the tensors in place (+1000, as
the next optimizer step does). Without the fix the checkpoint holds the updated values (phase
``compare``: :data:`scenarios.LATER_VALUES`); with it, the values at the save.

What is not real: on a CPU host the worker's CUDA calls (:mod:`mcore_ckpt_fixes.testing.persistent_worker`);
and the write waits :data:`WRITE_DELAY_S` in the worker (:func:`delayed_write`), so that the trainer's
update comes first every time, as with a checkpoint whose write outlasts a step.
"""

from __future__ import annotations

import functools
import inspect
import os
import time

import torch.distributed as dist

from ....testing.persistent_worker import on_cpu, within
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

NUMEL = 1 << 16  # per tensor and rank
DEADLINE_S = 120.0  # includes the worker's start (a spawned interpreter that imports Megatron)
WRITE_DELAY_S = 2.0  # a real checkpoint's write takes far longer than a training step


def delayed_write(write, *args, **kwargs):
    """The release's write, run by the worker (pickled by reference) after :data:`WRITE_DELAY_S`: the
    order a large checkpoint has (the trainer's next step before the write), every time."""
    time.sleep(WRITE_DELAY_S)
    return write(*args, **kwargs)


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401


def _sharded(tensors, rank, world_size):
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world_size), replica_id=0) for k, t in tensors.items()}


def _save(calls, state, path, rank, world_size, update):
    """One async save of ``state`` through the persistent worker; ``update``: the trainer's next step
    changes the tensors in place right after the save is scheduled."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    options = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        options["async_strategy"] = "mcore"  # Megatron-Core's own queue (0.17 on: nvrx is the default)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    request = dist_checkpointing.save(_sharded(state, rank, world_size), path, strategy, **options)
    calls.schedule_async_request(request._replace(async_fn=functools.partial(delayed_write, request.async_fn)))
    if update:
        for tensor in state.values():
            tensor.add_(1000.0)
    within(DEADLINE_S, calls.maybe_finalize_async_calls, blocking=True)


def _load(path, saved, rank, world_size):
    import torch
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(_sharded({k: torch.zeros_like(t) for k, t in saved.items()}, rank, world_size), path)


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    rt = RoundTrip()
    with rt.running(), on_cpu():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        state = {f"exp_avg_{i}": torch.full((NUMEL,), float(10 * rank + i + 1)) for i in range(2)}
        saved = {k: t.clone() for k, t in state.items()}
        calls = AsyncCallsQueue(persistent=True)
        rt.phase("save")
        _save(calls, state, os.path.join(ckpt_dir, "unchanged"), rank, world_size, update=False)
        rt.compare(saved, _load(os.path.join(ckpt_dir, "unchanged"), saved, rank, world_size), prefix="unchanged/")
        _save(calls, state, os.path.join(ckpt_dir, "next_step"), rank, world_size, update=True)
        calls.close()
        loaded = _load(os.path.join(ckpt_dir, "next_step"), saved, rank, world_size)
        rt.phase("compare")
        if all(torch.equal(loaded[k], saved[k] + 1000.0) for k in saved):
            raise AssertionError("the checkpoint holds the values the trainer wrote after the save was scheduled")
        rt.compare(saved, loaded)
    return rt.result
