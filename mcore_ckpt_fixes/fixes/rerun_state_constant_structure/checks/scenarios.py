"""rerun-state-constant-structure's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here). World 2: the real RerunStateMachine in VALIDATE_RESULTS mode with its error injector,
a steady-state save and a fault-time save through one cached torch_dist save plan, a resume in a new
machine; through megatron.training's save_checkpoint / load_checkpoint where the release ships it
(see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The fault-time save wrote the common entry (state WILL_RERUN_FROM_CHECKPOINT) but not the sharded
# rerun state; the resume's load request asks for it.
DROPPED = Bug.raises("load", "CheckpointException: Missing key in checkpoint state_dict: rerun_state_machine_state")

SCENARIOS = (
    Scenario(
        ID,
        "fault_after_cached_plan",
        f"{_CORE}:round_trip",
        2,
        DROPPED,
        prepare=f"{_CORE}:prepare",
        doc="rerun state machine (VALIDATE_RESULTS) saved at steady state and at a fault with one cached "
        "torch_dist save plan, resumed in a new machine",
    ),
)
