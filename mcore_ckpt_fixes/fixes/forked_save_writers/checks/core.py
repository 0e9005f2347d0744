"""forked-save-writers' round trips on 2 gloo ranks: ``dist_checkpointing.save`` in the ``torch_dist``
format (the release's default strategy, two write buckets per rank), as every save of 0.12-0.16
writes, then a load of what was saved.

``fork_fails``: every rank saves two tensors and loads them back (phase ``save``, ``compare``), then
saves again as ``--async-save`` does, through Megatron's default async caller, a forked process
(``async``, ``async/`` keys): where nothing goes wrong, the same bits with the fix off and on;
``writers`` says which processes wrote the buckets (the release: one forked per bucket; the fix:
the saving process, or the async caller's one). Then a second save where rank 0 cannot fork (``os.fork`` raises
``BlockingIOError``, errno EAGAIN, as it does when a large trainer's address space cannot be copied):
without the fix rank 0's save raises it (phase ``fork_fails``, on every rank: the world's first
failure); with it, nothing forks and the second save loads back exactly (``after/`` keys).

``write_dies`` (tests only, not a selftest scenario): rank 0's first bucket writer is killed by
SIGSEGV, as a crc32 segfault kills it. Without the fix its rank waits on the count queue and the
other in the barrier until the deadline (phase ``save``: :data:`scenarios.HANG`), and rank 0's
process stays alive, so a launcher never learns of it. With the fix the bucket is written by the
saving process itself, so the signal ends rank 0, as any crash of a trainer does, and a launcher
(torchrun) that sees a rank exit ends the job; rank 1 waits for its lost peer in the barrier until
then (gloo does not notice a dead peer within the deadline).

What stands in (private to these worlds): ``os.fork`` on rank 0, and a wrapper of the release's
per-bucket writer that notes which process wrote and delivers the signal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal

from ....testing.persistent_worker import within
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from ....testing.world_errors import WorldFailed, through_files
from .. import CLASS, ID, MODULE, PER_BUCKET

# A save of two small tensors takes well under a second; a save that ends normally never waits for
# these, a hung one waits the whole of HANG_S.
DEADLINE_S = 60.0
HANG_S = 10.0
FAILING_RANK = 0


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401


def _error_line(exc) -> str:
    return exc.error if isinstance(exc, WorldFailed) else f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _watched_writers(folder, crash_rank=None):
    """The release's per-bucket writer, noting in ``folder`` which process wrote each bucket; on
    ``crash_rank`` the first bucket's writer is killed by SIGSEGV."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    cls = getattr(filesystem_async, CLASS)
    release = cls.__dict__[PER_BUCKET]
    rank = dist.get_rank()

    def per_bucket(transform_list, local_proc_idx, *args, **kwargs):
        open(os.path.join(folder, f"writer.rank{rank}.bucket{local_proc_idx}.pid{os.getpid()}"), "w").close()
        if rank == crash_rank and local_proc_idx == 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        return release.__func__(transform_list, local_proc_idx, *args, **kwargs)

    setattr(cls, PER_BUCKET, staticmethod(per_bucket))
    try:
        yield
    finally:
        setattr(cls, PER_BUCKET, release)


@contextlib.contextmanager
def _fork_fails(rank):
    """``os.fork`` raises ``BlockingIOError`` on ``rank`` (elsewhere it forks)."""
    import torch.distributed as dist

    release = os.fork

    def fork():
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    if dist.get_rank() == rank:
        os.fork = fork
    try:
        yield
    finally:
        os.fork = release


def _state(rank, world_size, base):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    tensors = {key: torch.arange(64, dtype=torch.float32) + 1000 * i + 100 * rank + base for i, key in enumerate("ab")}
    sharded = {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world_size)) for k, t in tensors.items()}
    return tensors, sharded


def _save(path, sharded, asynchronous=False):
    """``dist_checkpointing.save``; ``asynchronous``: as ``--async-save`` saves on these releases, the
    request run by Megatron's default async caller (a forked process) and finalized blocking."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    if not asynchronous:
        dist_checkpointing.save(sharded, path)
        return
    calls = AsyncCallsQueue()
    calls.schedule_async_request(dist_checkpointing.save(sharded, path, async_sharded_save=True))
    calls.maybe_finalize_async_calls(blocking=True)
    calls.close()


def _load(path, rank, world_size):
    from megatron.core import dist_checkpointing

    _, template = _state(rank, world_size, -1.0)
    return dist_checkpointing.load(template, path)


def _writer_pids(folder, rank):
    return {int(n.rpartition("pid")[2]) for n in os.listdir(folder) if n.startswith(f"writer.rank{rank}.")}


def _saved_and_loaded(rt, rank, world_size, ckpt_dir, name, base, prefix="", asynchronous=False):
    """Save this rank's two tensors under ``ckpt_dir/name`` (bounded; a failure on any rank is the
    world's) and compare what loads back; ``{prefix}writers``: how many processes wrote this rank's
    buckets, and whether this one was among them."""
    path, notes = os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, f"{name}.writers")
    os.makedirs(notes, exist_ok=True)
    tensors, sharded = _state(rank, world_size, base)
    with _watched_writers(notes):
        through_files(rt.current_phase, lambda: within(DEADLINE_S, _save, path, sharded, asynchronous), ckpt_dir)
    pids = _writer_pids(notes, rank)
    rt[f"{prefix}writers"] = "this process" if pids == {os.getpid()} else f"{len(pids)} other process(es)"
    rt.compare(tensors, _load(path, rank, world_size), prefix=prefix)


def fork_fails(rank, world_size, ckpt_dir, patched, device="cpu"):
    rt = RoundTrip(error_line=_error_line, writers=None)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        from ....testing.dist_optimizer import world

        with world():
            rt.phase("save")
            _saved_and_loaded(rt, rank, world_size, ckpt_dir, "first", 0.0)
            rt.phase("async")
            _saved_and_loaded(rt, rank, world_size, ckpt_dir, "async", 0.25, prefix="async/", asynchronous=True)
            rt.phase("fork_fails")
            with _fork_fails(FAILING_RANK):
                _saved_and_loaded(rt, rank, world_size, ckpt_dir, "second", 0.5, prefix="after/")
    return rt.result


def write_dies(rank, world_size, ckpt_dir, patched, device="cpu"):
    rt = RoundTrip(error_line=_error_line)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        from ....testing.dist_optimizer import world

        with world():
            rt.phase("save")
            path = os.path.join(ckpt_dir, "iter")
            _, sharded = _state(rank, world_size, 0.0)
            with _watched_writers(ckpt_dir, crash_rank=FAILING_RANK):
                through_files("save", lambda: within(HANG_S, _save, path, sharded), ckpt_dir, wait=5.0)
    return rt.result


def sync_save_runs_in_this_process():
    """None where a synchronous ``torch_dist`` save writes from the saving process (0.15.0+:
    ``AsyncRequest.execute_sync``), else why ``fork_fails`` is not run: 0.12.0-0.14.0 run even a
    synchronous save through the module's ``AsyncCallsQueue``, whose caller forks one process for
    the write before any bucket; a fork that fails there stops the save with the fix too (the fix
    replaces the per-bucket processes inside it, not that one)."""
    import importlib
    import inspect

    try:
        base = importlib.import_module("megatron.core.dist_checkpointing.strategies.base")
    except ImportError:
        return None  # no such module: not the 0.12-0.14 layout
    save = getattr(getattr(base, "AsyncSaveShardedStrategy", None), "save", None)
    if save is not None and "async_calls" in inspect.unwrap(save).__code__.co_names:
        return (
            "this release runs a synchronous torch_dist save in a forked caller process (the module's "
            "AsyncCallsQueue), which this fix does not replace: a failing fork stops that save with the fix too"
        )
    return None
