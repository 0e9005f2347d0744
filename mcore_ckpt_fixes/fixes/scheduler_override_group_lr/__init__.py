"""scheduler-override-group-lr: ``--override-opt-param-scheduler`` overrides the learning rates of
every parameter group, not only the scheduler's own.

Each parameter group carries its own ``max_lr`` / ``min_lr``, from which the scheduler computes its
learning rate. ``load_checkpoint`` restores the groups from the checkpoint before the scheduler's
state, so a run resumed with a new ``--lr`` and ``--override-opt-param-scheduler`` gets the new value
in the scheduler and keeps the old one in every group: it trains on the saved schedule, silently.

Upstream: NVIDIA/Megatron-LM#1138, #1284, #7173; fixed on main in ``load_checkpoint`` (#3720).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "scheduler-override-group-lr"
MODULE = "megatron.core.optimizer_param_scheduler"
CLASS = "OptimizerParamScheduler"

FIX = Fix(
    id=ID,
    summary="--override-opt-param-scheduler gives every parameter group the run's own max_lr/min_lr back after a load",
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#1138, #1284, #7173: --override-opt-param-scheduler does not change the "
        "learning rate of the param groups restored from the checkpoint",
        "NVIDIA/Megatron-LM#3720: fixed on main in load_checkpoint (every non-decoupled group set to --lr)",
    ),
    targets=(Target(MODULE),),
)
