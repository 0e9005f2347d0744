"""dp-reshardable-padding's round trips as the suite and ``selftest`` find them (no torch, no
Megatron here).

World 2 (DP=2), Megatron's DDP and distributed optimizer, ``dp_reshardable``, ``dist_checkpointing``
(see checks/core.py). tests/fixes/test_dp_reshardable_padding.py runs every case of ``core.CASES``
in one world per half.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID, MODULE

_CORE = f"{__package__}.core"
_PREPARE = f"{_CORE}:prepare"
_FORMAT = (f"{MODULE}:DistributedOptimizer.sharded_param_state_dp_reshardable",)
AFFECTED = ">=0.15.0,<=0.19.2"

SCENARIOS = (
    Scenario(
        ID,
        "all_padding_shard",
        f"{_CORE}:all_padding_shard",
        2,
        {AFFECTED: Bug.raises("request", "AssertionError: empty bucket encountered")},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        requires=_FORMAT,
        doc="a bucket padded for high NCCL bus bandwidth leaves rank 1's half all padding",
    ),
    Scenario(
        ID,
        "past_unpadded_end",
        f"{_CORE}:past_unpadded_end",
        2,
        {AFFECTED: Bug.raises("save", "ValueError: Failed to validate global plan")},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        requires=_FORMAT,
        doc="the bucket before a tied embedding's ends past its last parameter; rank 1's shard runs past it",
    ),
)
