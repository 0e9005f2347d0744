"""async-save-pinned-buffers' round trip as the suite and ``selftest`` find it (nothing heavy imported
here): an asynchronous torch_dist save through the forked writer (``TemporalAsyncCaller``) on one
rank, the trainer's next device-to-host copies made while the writer has not written yet
(checks/core.py). On a CPU host pinned memory is stood in for (shared memory, pooled as torch's
caching host allocator pools pinned blocks); on a GPU the copies are torch's own."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# What the check says where the checkpoint holds the trainer's next copies (checks/core.py).
OVERWRITTEN = (
    "AssertionError: the checkpoint holds the trainer's next copies, written into its host buffers after the save began"
)

SCENARIOS = (
    Scenario(
        ID,
        "next_step_copies",
        f"{_CORE}:round_trip",
        1,
        {">=0.12.0,<0.17.0": Bug.raises("load", OVERWRITTEN)},
        prepare=f"{_CORE}:prepare",
        timeout=120.0,
        doc="an --async-save checkpoint (TemporalAsyncCaller's forked writer) written after the trainer's next "
        "device-to-host copies of the same sizes: it holds the step it saved, every tensor exact",
    ),
)
