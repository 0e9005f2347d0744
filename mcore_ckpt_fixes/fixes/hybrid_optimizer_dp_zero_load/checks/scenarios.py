"""hybrid-optimizer-dp-zero-load's round trips as the suite and ``selftest`` find them (nothing heavy
imported here): the distributed optimizer with CPU offload on 2 gloo ranks, saved and loaded in the
legacy torch format (dp_zero), compared right after the load and after two steps (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Raised by the check itself (checks/core.py: judge) where the resumed state differs from the saved
# run's: without the fix the model right after the load holds the fresh run's weights plus a random step.
STALE = Bug.raises("judge", "AssertionError: the resumed run is not the saved run")

SCENARIOS = (
    Scenario(
        ID,
        "full_offload",
        f"{_CORE}:full_offload",
        2,
        {">=0.16.0,<=0.19.2": STALE},
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        devices=("cpu",),
        doc="--optimizer-cpu-offload (fraction 1.0), legacy torch format: the state after the load, two steps",
    ),
    Scenario(
        ID,
        "partial_offload",
        f"{_CORE}:partial_offload",
        2,
        {">=0.16.0,<=0.19.2": STALE},
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        devices=("cpu",),
        # The second resumed step of the GPU FusedAdam needs its step to count on.
        alongside=("hybrid-optimizer-gpu-step",),
        doc="--optimizer-cpu-offload, fraction 0.5, legacy torch format: the state after the load, two steps",
    ),
)
