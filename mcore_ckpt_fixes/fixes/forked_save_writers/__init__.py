"""forked-save-writers: a ``torch_dist`` save on 0.12-0.16 writes its buckets from threads of the
saving process, not from processes it forks; a writer that cannot run no longer hangs the job.

``FileSystemWriterAsync.write_preloaded_data_multiproc`` forks one process per write bucket, for
synchronous saves too, and waits for each to mark a count queue done. A process that dies (the
segmentation faults in crc32 of #1861, the OOM killer) never does: its rank waits for ever, the
others in the save's barrier, and ``iter_*`` is left without ``.metadata``. A fork that fails
(``BlockingIOError``: a large trainer's address space cannot be copied) stops that rank's save.

Upstream: NVIDIA/Megatron-LM#1861, #3424 (reverted), #3633 (threads, in 0.17.0). Affected:
Megatron-Core 0.12.0-0.16.1. How: the writer the release hands out is swapped for one that runs the
release's own per-bucket writer in threads and collects the results the same way. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "forked-save-writers"
MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
CLASS = "FileSystemWriterAsync"
FUNCTION = "get_save_function_and_args"
FORKING = "write_preloaded_data_multiproc"  # the release's writer: a process per bucket
PER_BUCKET = "write_preloaded_data"  # the release's writer of one bucket, which both call

FIX = Fix(
    id=ID,
    summary=(
        "torch_dist saves write their buckets from threads: a forked write process that died (a crc32 "
        "segfault, the OOM killer) hung every rank with the iter_* directory unfinished, and a fork that "
        "failed (BlockingIOError) stopped the save"
    ),
    affected=">=0.12.0,<0.17.0",
    upstream=(
        "NVIDIA/Megatron-LM#1861 (segmentation faults in the forked writers)",
        "NVIDIA/Megatron-LM#3633 (writes from threads, in 0.17.0)",
    ),
    targets=(Target(MODULE),),
)
