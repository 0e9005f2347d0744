"""param-group-identity's round trip as the suite and ``selftest`` find it (no torch, no Megatron here).

World 2 (DP=2), Megatron's DDP and distributed optimizer, ``dist_checkpointing`` (see checks/core.py):
``decoupled_lr`` (defect (a), 0.16-0.18) and ``changed_lr`` (defect (b), 0.19).
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

# 0.19: the groups of a run whose --lr / --min-lr changed find no saved group (the first's key shown).
NO_SAVED_GROUP = Bug.raises("load", "KeyError: (None, 0.02, 0.002, None, None, 1.0, 1.0, False, False)")

SCENARIOS = (
    Scenario(
        ID,
        "decoupled_lr",
        f"{_CORE}:round_trip",
        2,
        {">=0.16.0,<0.19.0": ONE_SAVED_GROUP},
        batch=f"{_CORE}:cases",
        prepare=f"{_CORE}:prepare",
        doc="distributed optimizer with --decoupled-lr's parameter groups, saved and loaded (dp_reshardable)",
    ),
    Scenario(
        ID,
        "changed_lr",
        f"{_CORE}:changed_lr",
        2,
        {">=0.19.0,<=0.19.2": NO_SAVED_GROUP},
        batch=f"{_CORE}:cases",
        prepare=f"{_CORE}:prepare",
        doc="distributed optimizer saved with --lr 0.01, loaded into one built with --lr 0.02 --min-lr 0.002",
    ),
)
