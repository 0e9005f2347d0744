"""param-group-identity's round trip as the suite and ``selftest`` find it (no torch, no Megatron here).

World 2 (DP=2), Megatron's DDP and distributed optimizer with a decoupled learning rate,
``dist_checkpointing`` (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The groups alike but for max_lr both take the decoupled group (saved last among them), loaded
# through the ChainedOptimizer and through its DistributedOptimizer alone.
ONE_SAVED_GROUP = Bug.raises(
    "groups",
    "AssertionError: param groups' (max_lr, min_lr) after the load, saved [(0.01, 0.001), (0.03, 0.001), "
    "(0.01, 0.001)]: chained [(0.03, 0.001), (0.03, 0.001), (0.01, 0.001)]; alone [(0.03, 0.001), (0.03, 0.001), "
    "(0.01, 0.001)]",
)

SCENARIOS = (
    Scenario(
        ID,
        "decoupled_lr",
        f"{_CORE}:round_trip",
        2,
        {">=0.16.0,<0.19.0": ONE_SAVED_GROUP},
        prepare=f"{_CORE}:prepare",
        devices=("cpu",),
        doc="distributed optimizer with --decoupled-lr's parameter groups, saved and loaded (dp_reshardable)",
    ),
)
