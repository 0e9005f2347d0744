"""async-save-pinned-buffers: an asynchronous checkpoint holds the tensors of the step it saved, not
what the trainer wrote into their host buffers after the save began.

``--async-save`` without a persistent worker (``TemporalAsyncCaller``, the default asynchronous path
of 0.12-0.16) copies the checkpoint's tensors to pinned host memory, forks the process that writes
them, and drops its own references to those copies. Pinned memory is not copied on write across a
fork, and torch's caching host allocator hands the freed buffers to the trainer's next
device-to-host copies: the writer can then write whatever the trainer put there, silently.

Upstream: NVIDIA/Megatron-LM#2288 (fixed in 0.17.0); #1570 (sporadic 1e-42 values in a 0.12
checkpoint, open) may be the same bug.
Affected: Megatron-Core 0.12.0-0.16.1.
How: the caller keeps the staged copies until it has joined the writer, as 0.17 does. The rest is on
the page, doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "async-save-pinned-buffers"
MODULE = "megatron.core.dist_checkpointing.strategies.async_utils"
CLASS = "TemporalAsyncCaller"
FUNCTION = "schedule_async_call"
CLOSE = "close"

FIX = Fix(
    id=ID,
    summary=(
        "--async-save (the forked writer, TemporalAsyncCaller) keeps the host copies it writes until the writer "
        "has finished, instead of freeing pinned buffers that the trainer's next copies reuse while they are written"
    ),
    affected=">=0.12.0,<0.17.0",
    upstream=(
        "NVIDIA/Megatron-LM#2288 (fixed in 0.17.0)",
        "NVIDIA/Megatron-LM#1570 (sporadic 1e-42 values in a 0.12 checkpoint; open, may be the same bug)",
    ),
    targets=(Target(MODULE),),
)
