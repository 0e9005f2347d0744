"""persistent-worker-cpu-snapshot's round trip as the suite and ``selftest`` find it (nothing heavy
imported here): async torch_dist saves of CPU tensors through the persistent worker on 2 gloo ranks,
the trainer updating them right after the second save is scheduled (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Raised by the check itself (checks/core.py) where every tensor loaded holds the trainer's update.
LATER_VALUES = Bug.raises(
    "compare", "AssertionError: the checkpoint holds the values the trainer wrote after the save was scheduled"
)

SCENARIOS = (
    Scenario(
        ID,
        "round_trip",
        f"{_CORE}:round_trip",
        2,
        {">=0.13.0,<=0.19.2": LATER_VALUES},
        prepare=f"{_CORE}:prepare",
        devices=("cpu",),
        timeout=240.0,
        doc="async torch_dist saves of CPU tensors through the persistent worker; the next step updates them",
    ),
)
