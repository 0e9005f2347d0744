"""persistent-worker-cpu-snapshot: an async save through the persistent checkpoint worker
(``--use-persistent-ckpt-worker``) writes the CPU tensors as they were when the save was scheduled.

The writer copies GPU tensors to the host before the trainer goes on, but hands a tensor already on
the CPU (the CPU-offloaded optimizer's state, anything kept on the host) to the worker as it is:
the request goes through a multiprocessing queue, which moves the tensor's storage into shared
memory instead of copying it. The trainer waits only for the preload, not the write, so the next
step's in-place updates reach the checkpoint: a checkpoint of step N holds step N+1's CPU state,
silently. The forked (non-persistent) writer is not affected: the fork copies on write.

Upstream: the TODO in ``filesystem_async.py`` names it; nvidia-resiliency-ext#376 confirmed it in
its own copy. Affected: Megatron-Core 0.13.0-0.19.2 (measured on 0.13.1, 0.15.3, 0.16.1-0.19.2).
How: the request's CPU tensors are cloned before it is handed to the worker. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "persistent-worker-cpu-snapshot"
MODULE = "megatron.core.dist_checkpointing.strategies.async_utils"
CLASS = "PersistentAsyncCaller"
FUNCTION = "schedule_async_call"

FIX = Fix(
    id=ID,
    summary=(
        "an async save through the persistent checkpoint worker writes CPU tensors as they were when the save "
        "was scheduled, where it wrote what the next steps had changed in place"
    ),
    affected=">=0.13.0,<=0.19.2",
    upstream=(
        "NVIDIA/nvidia-resiliency-ext#376 (the same mechanism in its own copy)",
        "not fixed in Megatron-Core as of 0.19.2 (the TODO in strategies/filesystem_async.py)",
    ),
    targets=(Target(MODULE),),
)
