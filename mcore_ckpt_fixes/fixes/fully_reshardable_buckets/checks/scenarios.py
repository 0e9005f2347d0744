"""fully-reshardable-buckets' round trips as the suite and ``selftest`` find them (no torch, no
Megatron here).

World 2 (DP=2), Megatron's DDP (several buckets) and distributed optimizer, ``fully_reshardable``,
``dist_checkpointing`` (see checks/core.py). Each scenario is one case of ``core.CASES``;
tests/fixes/test_fully_reshardable_buckets.py runs them all in one world per half.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID, MODULE

_CORE = f"{__package__}.core"
_PREPARE = f"{_CORE}:prepare"
_FORMAT = (f"{MODULE}:DistributedOptimizer.sharded_param_state_fully_reshardable",)
# Silent in the release: the load completes and restores other values (the check says so).
WRONG_VALUES = Bug.raises("restored", "AssertionError: the load restored other values than the source saved")

SCENARIOS = (
    Scenario(
        ID,
        "buckets",
        f"{_CORE}:buckets",
        2,
        {">=0.15.0,<=0.19.2": WRONG_VALUES},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        requires=_FORMAT,
        doc="fully_reshardable save of a gradient buffer in several buckets, loaded into the same layout",
    ),
    Scenario(
        ID,
        "reshard",
        f"{_CORE}:reshard",
        2,
        {">=0.15.0,<=0.19.2": WRONG_VALUES},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        requires=_FORMAT,
        doc="the same checkpoint loaded into a gradient buffer of one bucket",
    ),
)
