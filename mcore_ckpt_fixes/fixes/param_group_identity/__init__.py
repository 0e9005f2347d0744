"""param-group-identity: a resumed optimizer gives each parameter group its own saved learning-rate
and weight-decay overrides.

Affected: Megatron-Core 0.16.0-0.18.x (0.19.0 matches groups by every override key), in
``megatron/core/optimizer/optimizer.py`` and ``distrib_optimizer.py``. From 0.16.0 parameter groups
are built from overrides (``ParamGroupOverride``: ``max_lr``, ``min_lr``, ``start_wd``, ``end_wd``;
``--decoupled-lr`` is one: the embedding and output layer's group gets its own ``max_lr``), but a load
matches saved groups to current ones by ``param_group_identifier_keys`` = (``wd_mult``, ``lr_mult``,
``is_expert_parallel``, ``is_decoupled_lr``) only, and the decoupled group keeps ``is_decoupled_lr``
False. Groups that differ only in an override are alike: both take the same saved group, and one
resumes with the other's ``max_lr`` / ``min_lr`` (``DistributedOptimizer.load_state_dict``, and
``MegatronOptimizer._filter_and_reorder_param_groups`` for the other optimizers). Nothing fails:
the scheduler drives that group at the wrong learning rate from the first resumed step.

How (runtime/core.py): during a load, the identifier keys are the release's plus every override key
all groups carry, where the release's alone leave two groups alike and the longer ones match every
current group to exactly one saved group; otherwise (an override changed since the save) the
release's matching, with a warning naming the groups. Replaced: ``DistributedOptimizer.load_state_dict``
(standalone, as Megatron-FSDP returns it, or inside the ``ChainedOptimizer`` that
``get_megatron_optimizer`` returns and ``load_checkpoint`` loads) and
``MegatronOptimizer._filter_and_reorder_param_groups`` (the other optimizers), and in both modules
``param_group_identifier_keys``, by a tuple equal to the release's that iterates the chosen keys
inside those two methods only.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "param-group-identity"
MODULE = "megatron.core.optimizer.optimizer"
DISTRIB_MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "A resumed optimizer gives each parameter group its own saved learning-rate overrides "
        "(--decoupled-lr: groups alike but for max_lr took one saved group)"
    ),
    affected=">=0.16.0,<0.19.0",
    upstream=("fixed in Megatron-Core 0.19.0 (param_group_identifier_keys include every ParamGroupOverride key)",),
    targets=(
        Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),
        Target(DISTRIB_MODULE, f"{__name__}.runtime.core:probe_distrib", f"{__name__}.runtime.core:apply_distrib"),
    ),
)
