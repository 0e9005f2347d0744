"""rerun-transient-checkpoint's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here). World 2: the real RerunStateMachine in VALIDATE_RESULTS mode with its error injector
set to a transient error, the checkpoint it asks for at that fault saved and resumed in a new
machine; through megatron.training's save_checkpoint / load_checkpoint where the release ships it
(see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The resumed machine is in RERUNNING_IN_PLACE and restores the step's RNG snapshot, never saved.
CRASH = Bug.raises("resume", "TypeError: 'NoneType' object is not subscriptable")

SCENARIOS = (
    Scenario(
        ID,
        "transient_fault_checkpoint",
        f"{_CORE}:round_trip",
        2,
        CRASH,
        prepare=f"{_CORE}:prepare",
        applicable=f"{_CORE}:exit_asks_for_checkpoint",
        doc="rerun state machine (VALIDATE_RESULTS) at a transient fault: the checkpoint it asks for "
        "saved, resumed in a new machine, next step run",
    ),
)
