"""scheduler-checkpoint-wd's round trip as the suite and ``selftest`` find it (no torch, no Megatron
here). World 2: saved with one weight-decay schedule, resumed with other weight-decay arguments and
``--use-checkpoint-opt_param-scheduler``; every param group's lr and weight decay compared with the
checkpoint's schedule after the saved steps (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Silent in the release: the round trip says it (checks/core.py's WRONG_WD).
NEW_ARGUMENTS_WD = Bug.raises(
    "schedule", "AssertionError: the param groups' weight decay after the load is not the checkpoint schedule's"
)

SCENARIOS = (
    Scenario(
        ID,
        "checkpoint_wd_after_load",
        f"{_CORE}:round_trip",
        2,
        NEW_ARGUMENTS_WD,
        prepare=f"{_CORE}:prepare",
        # Before 0.15 the optimizer saves in model space, which calls numpy's product (gone in numpy 2).
        alongside=("numpy2-product",),
        doc="distributed optimizer and its scheduler saved with a weight decay rising from 0.01 to 0.02, "
        "loaded with a constant 0.05 and --use-checkpoint-opt_param-scheduler (dist_checkpointing; "
        "megatron.training's --weight-decay 0.01 -> 0.05 where the release ships it): every group's lr "
        "and weight decay as the checkpoint's schedule gives them, and as the release with the arguments unchanged",
    ),
)
