"""forked-save-writers in a job: the layer on ``FileSystemWriterAsync.get_save_function_and_args``
and the probe. Why: doc.md.

The release hands its save (synchronous, or run by the async caller) ``write_preloaded_data_multiproc``,
which forks a process per write bucket and waits on a count queue that only those processes can
release. The layer hands out :func:`write_buckets_in_threads` instead: the same per-bucket writer of
the release, run in threads of the process that saves, whose results reach the save's results queue
as the release's do. A bucket's failure is reported as the release reports it; nothing waits on a
process that may be gone.
"""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import threading
import types

from megatron.core.dist_checkpointing.strategies.async_utils import _disable_gc
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, FORKING, FUNCTION, ID, MODULE

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# FileSystemWriterAsync (megatron/core/dist_checkpointing/strategies/filesystem_async.py).


def write_buckets_in_threads(transform_list, use_msc, rank, write_buckets, global_results_queue):
    """Write every bucket with the release's per-bucket writer, each in a thread of this process,
    and put ``{bucket index: write results}`` (or the first bucket's exception) on
    ``global_results_queue``, as the forking writer does. Threads share the saving process: nothing
    is forked, and a bucket whose writer ends without a result is an error, not a wait."""
    extra = {"use_msc": True} if use_msc else {}  # the per-bucket writer takes it from 0.13 on
    results, started = queue.Queue(), queue.Queue()  # started: what the per-bucket writer marks done
    # The garbage collector stays off while buckets are written, as the release keeps it off in its
    # writer processes (a forked async writer must not collect tensors its parent owns).
    with _disable_gc():
        threads = []
        for index, bucket in enumerate(write_buckets):
            started.put(index)
            thread = threading.Thread(
                target=FileSystemWriterAsync.write_preloaded_data,
                args=(transform_list, index, bucket, results, started, True),
                kwargs=extra,
                name=f"checkpoint-writer-{index}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    global_results_queue.put(_gathered(results, len(write_buckets), rank))


def _gathered(results, expected, rank):
    """``{bucket index: write results}``, or the first exception a bucket's writer reported (or
    a RuntimeError where one ended without reporting)."""
    gathered = {}
    for _ in range(expected):
        try:
            index, outcome = results.get_nowait()
        except queue.Empty:
            missing = sorted(set(range(expected)) - set(gathered))
            return RuntimeError(f"rank {rank}: the checkpoint writer of bucket(s) {missing} ended without a result")
        if isinstance(outcome, Exception):
            logging.getLogger(__name__).error(f"rank {rank}: writing checkpoint bucket {index} failed: {outcome}")
            return outcome
        gathered[index] = outcome
    return gathered


# -- end of replacement ---


def _forks(save_fn, writer_cls) -> bool:
    """Is ``save_fn`` (what ``get_save_function_and_args`` returned first) the release's forking
    writer, bound to its transforms (and, from 0.13, ``use_msc``)?"""
    forking = getattr(writer_cls, FORKING, None)
    return isinstance(save_fn, functools.partial) and forking is not None and save_fn.func is forking


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def get_save_function_and_args(release, self):
    """The release's save function and arguments, with the forking writer swapped for
    :func:`write_buckets_in_threads` (same transforms, same ``use_msc``, same arguments)."""
    found = release(self)
    save_fn = found[0]
    if not _forks(save_fn, type(self)):
        return found
    transform_list, *use_msc = save_fn.args  # 0.12 binds no use_msc
    threaded = functools.partial(write_buckets_in_threads, transform_list, bool(use_msc and use_msc[0]))
    return (threaded, *found[1:])


# -- probe: what the release's save function runs -----------------------------------------------


def _code_names(fn) -> set:
    return set(inspect.unwrap(fn).__code__.co_names)


def probe(module: types.ModuleType):
    """Judged by the code's names, not by a run: the writer forks processes, which a probe at import
    must not do, and the save function is built from ``torch.distributed``'s rank."""
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION}"
    names = _code_names(original(cls, FUNCTION))
    if FORKING in names and FORKING in cls.__dict__:
        forking = _code_names(getattr(cls, FORKING))
        if {"Process", "JoinableQueue", "join"} <= forking:
            return True, (
                f"{CLASS}.{FUNCTION} hands out {FORKING}, which forks a process per bucket and waits on a "
                "count queue only those processes release: a writer that dies hangs every rank"
            )
        return None, f"{CLASS}.{FORKING} is not the forking writer this fix knows"
    # 0.17's write_preloaded_data_multithread; this fix's source diff's write_preloaded_data_threads
    threaded = sorted(n for n in names if "thread" in n and (n in cls.__dict__ or n in module.__dict__))
    if FORKING not in names and threaded:
        return False, f"{CLASS}.{FUNCTION} hands out {threaded[0]}, which writes from threads"
    return None, f"{CLASS}.{FUNCTION} hands out a writer this fix does not know"
