"""persistent-worker-failure's round trips as the suite and ``selftest`` find them (nothing heavy
imported here): the persistent checkpoint worker on 2 gloo ranks, one rank's worker dying during a
save's write (``dies``) or preload (``dies_in_preload``), after a save where none does: checks/core.py."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Raised by the check itself (checks/core.py: within) on every rank whose save still waits at the
# deadline: the dead worker's rank polls its empty completion queue (or waits for the preload's
# acknowledgement), the other waits in the all-reduce.
HANG = Bug.raises("finalize", "TimeoutError: save_and_finalize did not return within 15 s")
# Where the fix is on: every rank's error (rank 0's worker died; rank 1's finished).
DIED_HERE = "PersistentWorkerDied: the persistent checkpoint worker of 1 rank(s) exited before it finished the save (this rank's among them): the checkpoint is incomplete; the worker's error is in that rank's log"
DIED_ELSEWHERE = "PersistentWorkerDied: the persistent checkpoint worker of 1 rank(s) exited before it finished the save (this rank's worker finished or is alive): the checkpoint is incomplete; the worker's error is in that rank's log"

# The worker writes host tensors (on a GPU host, what Megatron's preload copied off the GPU): the
# round trip holds its tensors on the CPU on every host, so a CUDA run would repeat the CPU one.
CPU_ONLY = ("cpu",)

SCENARIOS = (
    Scenario(
        ID,
        "dies",
        f"{_CORE}:dies",
        2,
        {">=0.12.0,<=0.19.2": HANG},
        prepare=f"{_CORE}:prepare",
        timeout=150.0,
        devices=CPU_ONLY,
        doc="persistent worker: rank 0's write raises in the worker; every rank finalizes with blocking=True",
    ),
    Scenario(
        ID,
        "dies_in_preload",
        f"{_CORE}:dies_in_preload",
        2,
        {">=0.12.0,<=0.19.2": HANG},
        prepare=f"{_CORE}:prepare",
        timeout=150.0,
        devices=CPU_ONLY,
        doc="persistent worker: rank 0's preload raises in the worker (the trainer waits for its acknowledgement)",
    ),
)
