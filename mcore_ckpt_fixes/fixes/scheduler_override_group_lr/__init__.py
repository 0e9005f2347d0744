"""scheduler-override-group-lr: ``--override-opt-param-scheduler`` overrides the learning rates of
every parameter group, not only the scheduler's own.

Affected: Megatron-Core 0.12.0 - 0.19.2 (NVIDIA/Megatron-LM#1138, #1284, #7173; upstream main fixes
it in megatron.training's load_checkpoint from the arguments, #3720, which sets every group but the
decoupled one to ``--lr``). On 0.19 the load with a changed ``--lr`` stops before the scheduler's
state is read, unless param-group-identity matches the groups; then this is what follows.

Failure prevented: each parameter group carries its own ``max_lr`` / ``min_lr`` (``--lr`` /
``--min-lr``, the decoupled group's ``--decoupled-lr``, a group override's), and the scheduler
computes every group's learning rate from those. ``load_checkpoint`` restores the optimizer's param
groups from the checkpoint before the scheduler's state, so a run resumed with a new ``--lr`` and
``--override-opt-param-scheduler`` gets the new value in the scheduler and keeps the old one in
every group: it trains on the saved schedule, without a word (verl turns the override on whenever
``use_checkpoint_opt_param_scheduler`` is off).

How: the scheduler remembers each group's ``max_lr`` / ``min_lr`` as the run built them (at its
construction, before any load); when it loads its state with the override on, it gives each group
back those values and sets the groups' learning rate and weight decay from them. Groups keep their
own values (a decoupled or overridden group is not set to ``--lr``). Without the override nothing
changes.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
