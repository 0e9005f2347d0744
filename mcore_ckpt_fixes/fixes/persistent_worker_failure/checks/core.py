"""persistent-worker-failure's round trips on 2 gloo ranks: Megatron-Core's ``AsyncCallsQueue`` with
the persistent worker (``persistent=True``, as ``--use-persistent-ckpt-worker`` builds it), one save
request per rank whose write goes through the worker, then ``maybe_finalize_async_calls(blocking=True)``
on every rank, as ``megatron.training`` finalizes a save, bounded by :data:`DEADLINE_S` (once the
worker runs).

Every rank saves one tensor (phase ``save``, which starts the worker) and loads it back
(``compare``): where no worker dies, the release's own path, the same bits with the fix off and on.
``dies``: then a second save whose write raises in rank 0's worker (as a failed device-to-host
copy, or the OOM killer, ends it), so the worker exits without answering. Without the fix every
rank's finalization is still waiting at the deadline (phase ``finalize``: :data:`scenarios.HANG`);
with it every rank raises the fix's error (``worker_died``), closes its worker as the caller's
``__del__`` does at exit (no abort: the release would join the dead worker's queue for ever; here
bounded by :data:`DEADLINE_S`), and loads the first save back exactly (``reload``: ``after/`` keys). ``dies_in_preload``: the same, but the second save
preloads in the worker (as Megatron's writer does with a persistent worker) and rank 0's preload
raises: without the fix rank 0 also waits for ever, for the preload's acknowledgement.

What is not real on a CPU host: the worker's CUDA calls, and its exit after the error, which is
immediate (``os._exit``, as a hard exit is) instead of a teardown at the low CPU priority the release
gives the worker, which on a loaded host can outlast the deadline
(:mod:`mcore_ckpt_fixes.testing.persistent_worker`).
"""

from __future__ import annotations

import os

from ....testing.persistent_worker import on_cpu, within
from ....testing.result import RoundTrip, error_line
from ....testing.states import fix_states
from .. import ID, MODULE

STARTUP_DEADLINE_S = 90.0  # a save that starts the worker: a spawned interpreter imports torch and Megatron
# A save through a running worker takes milliseconds; a dead worker is seen once its process has
# exited, which on a loaded host can take seconds after the error (interpreter teardown).
DEADLINE_S = 15.0
DYING_RANK = 0


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401


def write_shard(path: str, tensor, rank: int, dying_rank) -> None:
    """The save's write, run in the worker (pickled by reference); ``dying_rank``'s fails."""
    import torch

    if rank == dying_rank:
        raise OSError(f"rank {rank}: the checkpoint's write failed in the persistent worker")
    torch.save(tensor, path)


def preload_shard(tensor, rank: int, dying_rank):
    """The save's preload, run in the worker before the write (pickled by reference): what the
    write gets as its second argument; ``dying_rank``'s fails."""
    if rank == dying_rank:
        raise RuntimeError(f"rank {rank}: the checkpoint's preload failed in the persistent worker")
    return tensor


def save_and_finalize(calls, request):
    """Schedule ``request`` and finalize it as megatron.training does at the end of a run."""
    calls.schedule_async_request(request)
    return calls.maybe_finalize_async_calls(blocking=True)


def _save(calls, path, tensor, rank, dying_rank, deadline, preload=False):
    """One save request through the persistent worker (its write, or with ``preload`` its preload,
    failing on ``dying_rank``), within ``deadline`` seconds: how many finalize functions ran."""
    import functools

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    finalized = []
    args = (path, None if preload else tensor, rank, None if preload else dying_rank)
    staged = functools.partial(preload_shard, tensor, rank, dying_rank) if preload else None
    request = AsyncRequest(write_shard, args, [lambda: finalized.append(path)], preload_fn=staged)
    within(deadline, save_and_finalize, calls, request)
    return len(finalized)


def _save_and_load(rank, ckpt_dir, in_preload, rt):
    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    tensor = torch.arange(8, dtype=torch.float32) + 100 * rank
    path = os.path.join(ckpt_dir, f"shard_{rank}.pt")
    calls = AsyncCallsQueue(persistent=True)
    rt.phase("save")  # the first save starts the worker (a fresh interpreter that imports Megatron)
    rt["finalized"] = _save(calls, path, tensor, rank, None, STARTUP_DEADLINE_S)
    rt.phase("compare")  # where no worker dies: the release's own save, with the fix off and on
    rt.compare({"shard": tensor}, {"shard": torch.load(path)})
    rt.phase("finalize")
    try:
        _save(calls, path + ".next", tensor + 1, rank, DYING_RANK, DEADLINE_S, preload=in_preload)
    except RuntimeError as exc:  # the fix's PersistentWorkerDied, or a patched source's error
        if "persistent checkpoint worker" not in str(exc):
            raise
        rt["worker_died"] = error_line(exc)
    # Where the worker died: its caller closed as at exit (``__del__``: no abort, which 0.12-0.14 do
    # not have), within the deadline; the release would join the dead worker's queue for ever.
    caller = getattr(calls, "persistent_caller", None) or calls._persistent_caller  # the name from 0.19
    within(DEADLINE_S, caller.close)
    rt.phase("reload")  # the checkpoint saved before is intact
    rt.compare({"shard": tensor}, {"shard": torch.load(path)}, prefix="after/")


def _run(rank, ckpt_dir, patched, in_preload):
    rt = RoundTrip(worker_died=None, finalized=None)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        with on_cpu():
            _save_and_load(rank, ckpt_dir, in_preload, rt)
    return rt.result


def dies(rank, world_size, ckpt_dir, patched, device="cpu"):
    return _run(rank, ckpt_dir, patched, in_preload=False)


def dies_in_preload(rank, world_size, ckpt_dir, patched, device="cpu"):
    return _run(rank, ckpt_dir, patched, in_preload=True)
