"""hybrid-optimizer-gpu-step's round trips as the suite and ``selftest`` find them (nothing heavy
imported here): the distributed optimizer with CPU offload of half the parameters, or of none, on 2
gloo ranks, saved, loaded into a fresh run, two steps against the uninterrupted run (checks/core.py)."""

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

# With nothing offloaded the checkpoint holds no step, and the resumed FusedAdam counts from 0.
LOST = Bug.raises(
    "steps",
    "AssertionError: the GPU FusedAdam's step after two resumed steps is [2, 2], the uninterrupted run's [5, 5]",
)
# The load reads the optimizer classes the hybrid optimizer keeps in the common state, which torch's
# weights_only load refuses without that fix; before 0.15 the model-space save calls numpy's
# product, gone in numpy 2.
ALONGSIDE = ("hybrid-optimizer-common-state", "numpy2-product")

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
        alongside=ALONGSIDE,
        doc="--optimizer-cpu-offload, offload fraction 0.5, fully_reshardable (model space before 0.15): resume, two steps",
    ),
    Scenario(
        ID,
        "gpu_only",
        f"{_CORE}:gpu_only",
        2,
        {">=0.13.0,<=0.19.2": LOST},
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        devices=("cpu",),
        alongside=ALONGSIDE,
        doc="--optimizer-cpu-offload, offload fraction 0 (no CPU optimizer), fully_reshardable (model space before 0.15): resume, two steps",
    ),
)
