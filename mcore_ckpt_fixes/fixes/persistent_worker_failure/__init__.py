"""persistent-worker-failure: a persistent checkpoint worker (``--use-persistent-ckpt-worker``) that
dies during a save stops every rank with one error, where every rank waited forever.

The worker takes the save's request from a queue and answers on a completion queue. If it dies
first (an exception in the request's preload or write function, ``os._exit``, the OOM killer), no
answer comes: ``PersistentAsyncCaller.is_current_async_call_done`` polls the empty queue forever
(``blocking=True``) or reports the save as still running at every poll, and the other ranks wait in
its all-reduce. The job hangs at the next checkpoint finalization, with the save incomplete.

Upstream: NVIDIA/Megatron-LM#6970 (open), PR #6971 (open). Affected: Megatron-Core 0.12.0-0.19.2.
How: the poll checks the worker's liveness while it waits; a dead worker's rank says so in the
all-reduce every rank already makes, and every rank raises. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "persistent-worker-failure"
MODULE = "megatron.core.dist_checkpointing.strategies.async_utils"
CLASS = "PersistentAsyncCaller"
FUNCTION = "is_current_async_call_done"
BASE = "AsyncCaller"
SYNC = "sync_all_async_calls"

FIX = Fix(
    id=ID,
    summary=(
        "a persistent checkpoint worker (--use-persistent-ckpt-worker) that dies during a save stops every "
        "rank with one error naming it, where every rank waited forever for its answer"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#6970 (persistent worker failures are not propagated; open)",
        "NVIDIA/Megatron-LM#6971 (propagate them; open, not in a release as of 0.19.2)",
    ),
    targets=(Target(MODULE),),
)
