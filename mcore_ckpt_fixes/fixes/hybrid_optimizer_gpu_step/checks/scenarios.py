"""hybrid-optimizer-gpu-step's round trip as the suite and ``selftest`` find it (nothing heavy imported
here): the distributed optimizer with CPU offload of half the parameters on 2 gloo ranks, saved,
loaded into a fresh run, two steps against the uninterrupted run (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Raised by the check itself (checks/core.py: run_case): after a load at step 3 the release sets the
# GPU FusedAdam's step back to 3 before each step, so two steps leave it at 4 (each of its two param groups).
FROZEN = Bug.raises(
    "steps",
    "AssertionError: the GPU FusedAdam's step after two resumed steps is [4, 4], the uninterrupted run's [5, 5]",
)

SCENARIOS = (
    Scenario(
        ID,
        "partial_offload",
        f"{_CORE}:partial_offload",
        2,
        {">=0.13.0,<=0.19.2": FROZEN},
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        devices=("cpu",),
        # The load reads the optimizer classes the hybrid optimizer keeps in the common state, which
        # torch's weights_only load refuses without that fix.
        alongside=("hybrid-optimizer-common-state",),
        doc="--optimizer-cpu-offload, offload fraction 0.5, fully_reshardable: resume, two steps",
    ),
)
