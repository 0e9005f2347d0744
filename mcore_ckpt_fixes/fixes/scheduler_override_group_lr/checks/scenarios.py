"""scheduler-override-group-lr's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here). World 2: saved with one learning-rate schedule, resumed with another and
``--override-opt-param-scheduler``; every param group's max_lr, min_lr and lr compared with a run
that trained with the new schedule (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Silent in the release: the round trip says it (checks/core.py's WRONG_SCHEDULE).
OLD_SCHEDULE = Bug.raises(
    "schedule", "AssertionError: the param groups' max_lr/min_lr/lr after the load are not the new schedule's"
)

SCENARIOS = (
    Scenario(
        ID,
        "override_after_load",
        f"{_CORE}:round_trip",
        2,
        OLD_SCHEDULE,
        prepare=f"{_CORE}:prepare",
        applicable=f"{_CORE}:changed_lr_loads",
        # 0.19: without it the changed learning rates stop the optimizer's load (its own bug)
        # before the scheduler is read. Before 0.15 the optimizer saves in model space, which calls
        # numpy's product (gone in numpy 2).
        alongside=("param-group-identity", "numpy2-product"),
        doc="distributed optimizer with a decoupled group and its scheduler saved with --lr 0.01, loaded "
        "with --lr 0.02 and --override-opt-param-scheduler (dist_checkpointing; megatron.training where "
        "the release ships it): every group's max_lr/min_lr/lr as a run with the new schedule",
    ),
)
