"""hybrid-optimizer-chained-step's round trips as the suite and ``selftest`` find them (nothing heavy
imported here): a dense and an expert distributed optimizer over hybrid optimizers, chained, with
every parameter offloaded or half of them, on one gloo rank: saved, loaded into a fresh run, two
steps against the uninterrupted run (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# DistributedOptimizer.load_state_dict builds a tensor of the groups' common step, which the save
# wrote as None into every group of the hybrid optimizers.
LOAD_FAILS = Bug.raises("load", "TypeError: must be real number, not NoneType")
# The None reaches the GPU FusedAdam's groups at the save; its next step adds 1 to it.
NEXT_STEP_FAILS = Bug.raises("save", "TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'")
# The load reads the optimizer classes the hybrid optimizer keeps in the common state (refused by
# torch's weights_only load without that fix); the GPU FusedAdam's step is restored after a load
# only with hybrid-optimizer-gpu-step; 0.14's save calls numpy's product, gone in numpy 2.
ALONGSIDE = ("hybrid-optimizer-common-state", "hybrid-optimizer-gpu-step", "numpy2-product")

SCENARIOS = (
    Scenario(
        ID,
        "full_offload",
        f"{_CORE}:full_offload",
        1,
        LOAD_FAILS,
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        devices=("cpu",),
        alongside=ALONGSIDE,
        doc="--optimizer-cpu-offload, chained dense and expert optimizers, offload fraction 1.0: resume, two steps",
    ),
    Scenario(
        ID,
        "partial_offload",
        f"{_CORE}:partial_offload",
        1,
        NEXT_STEP_FAILS,
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        devices=("cpu",),
        alongside=ALONGSIDE,
        doc="--optimizer-cpu-offload, chained dense and expert optimizers, offload fraction 0.5: resume, two steps",
    ),
)
