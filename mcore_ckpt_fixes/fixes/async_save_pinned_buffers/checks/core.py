"""async-save-pinned-buffers' round trip on one rank: an asynchronous ``torch_dist`` save through
``TemporalAsyncCaller`` (``AsyncCallsQueue()``, the path ``--async-save`` takes without a persistent
worker), then, while its writer process has not written yet, the trainer's next device-to-host
copies of tensors of the same sizes; the checkpoint, finalized and loaded, must hold the values of
the step it saved.

The writer is held (an event the rank sets once its next copies are done) so that the order in which
a real job gets there, a writer still writing gigabytes while the trainer has moved on, is the order
every run takes. On a GPU the copies are torch's own: pinned host memory from its caching allocator.
A CPU host has no pinned memory (no CUDA), so there :class:`PinnedCopies` stands in for it: a
device-to-host copy (``Tensor.to("cpu", non_blocking=True)``) lands in a buffer of shared memory,
which a fork does not copy on write, as pinned pages are not; a buffer goes back to the pool for the
next copy of its size when its tensor is freed, as the caching host allocator's blocks do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import weakref

import torch
from torch.overrides import TorchFunctionMode

from ....testing.dist_optimizer import values
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE
from .scenarios import OVERWRITTEN

SHAPES = {"model.weight": (64, 32), "model.bias": (64,), "optimizer.exp_avg": (64, 32)}
NEXT_STEP = 1000.0  # what the trainer's next copies add: far from any saved value
WRITER_WAIT_S = 60.0


def prepare() -> None:
    """In the parent of a forked world: the modules the rank uses."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return target is not None and torch.device(target).type == "cpu"


class PinnedCopies(TorchFunctionMode):
    """Pinned host memory and torch's caching host allocator, stood in for on a CPU host (see the
    module's docstring): ``Tensor.to("cpu", non_blocking=True)`` copies into a pooled buffer of
    shared memory; the buffer returns to the pool when the copy is freed."""

    def __init__(self):
        super().__init__()
        self.free = {}  # (numel, dtype) -> buffers no live copy holds

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and kwargs.get("non_blocking") and _to_cpu(args, kwargs):
            return self._copy(args[0])
        return func(*args, **kwargs)

    def _copy(self, src):
        pool = self.free.setdefault((src.numel(), src.dtype), [])
        buffer = pool.pop() if pool else torch.empty(src.numel(), dtype=src.dtype).share_memory_()
        buffer.copy_(src.detach().reshape(-1))
        copy = buffer.view(src.shape)
        weakref.finalize(copy, pool.append, buffer)
        return copy


def _held(event, write, *args, **kwargs):
    """The writer process: waits until the trainer's next copies are done, then writes."""
    event.wait(WRITER_WAIT_S)
    return write(*args, **kwargs)


def _sharded(tensors):
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}


def _save_then_copy_on(path, saved, rt):
    """The asynchronous save of ``saved``; the trainer's next copies while its writer waits; the save
    finalized. Returns those copies (held, as a trainer holds its host tensors, until the save is done)."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    # Megatron's own asynchronous path (0.19 asks for it by name: its default there is NVRx's).
    mcore_path = (
        {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters else {}
    )
    request = dist_checkpointing.save(_sharded(saved), path, async_sharded_save=True, **mcore_path)
    writer_may_go = multiprocessing.get_context("fork").Event()
    request = request._replace(async_fn=functools.partial(_held, writer_may_go, request.async_fn))
    calls = AsyncCallsQueue()
    calls.schedule_async_request(request)
    rt.phase("next step")
    next_copies = [(t + NEXT_STEP).to("cpu", non_blocking=True) for t in saved.values()]
    writer_may_go.set()
    rt.phase("finalize")
    calls.maybe_finalize_async_calls(blocking=True)
    calls.close()
    return next_copies


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    rt = RoundTrip()
    path = os.path.join(ckpt_dir, "async")
    on_gpu = device == "cuda" and torch.cuda.is_available()
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        mpu.initialize_model_parallel()
        where = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        saved = {k: values(11, k, shape=s).to(where) for k, s in SHAPES.items()}
        rt["device"] = str(where)
        os.makedirs(path, exist_ok=True)
        rt.phase("save")
        with contextlib.nullcontext() if on_gpu else PinnedCopies():
            _save_then_copy_on(path, saved, rt)
        rt.phase("load")
        loaded = dist_checkpointing.load(_sharded({k: torch.zeros_like(t) for k, t in saved.items()}), path)
        loaded = {k: torch.as_tensor(loaded[k]).to(where) for k in SHAPES}
        if all(torch.equal(loaded[k], saved[k] + NEXT_STEP) for k in SHAPES):
            raise AssertionError(OVERWRITTEN.partition(": ")[2])
        rt.compare(saved, loaded)
    return rt.result
