"""param-group-identity: a resumed optimizer gives each parameter group its own saved group, also
when the run's learning rate changed since the save.

Affected: Megatron-Core 0.16.0-0.19.2, in ``megatron/core/optimizer/optimizer.py`` and
``distrib_optimizer.py``: a load matches the checkpoint's parameter groups to the optimizer's by
``param_group_identifier_keys``, with two defects of those keys.

(a) 0.16.0-0.18.x: parameter groups are built from overrides (``ParamGroupOverride``: ``max_lr``,
``min_lr``, ``start_wd``, ``end_wd``; ``--decoupled-lr`` is one: the embedding and output layer's group
gets its own ``max_lr``), but the keys are (``wd_mult``, ``lr_mult``, ``is_expert_parallel``,
``is_decoupled_lr``) only, and the decoupled group keeps ``is_decoupled_lr`` False. Groups that differ
only in an override are alike: both take the same saved group, and one resumes with the other's
``max_lr`` / ``min_lr``. Nothing fails: the scheduler drives that group at the wrong learning rate
from the first resumed step.

(b) 0.19.0-0.19.2: the keys hold every override key, ``max_lr`` and ``min_lr`` among them, which
every group takes from the run's ``--lr`` / ``--min-lr`` (``--decoupled-lr``). A run resumed with
a changed learning rate finds no saved group for its groups: ``load_checkpoint`` stops with
``KeyError: (None, <new lr>, <new min-lr>, ...)`` in ``DistributedOptimizer.load_state_dict``
(``ValueError: Could not find parameter group ...`` in the other optimizers), with
``--override-opt-param-scheduler`` or ``--use-checkpoint-opt-param-scheduler`` alike
(NVIDIA/Megatron-LM#3720 changes the learning rates after the load on main).

How (runtime/core.py): during a load, the identifier keys are the release's where they give every
current group exactly one saved group; where they leave two groups alike, also every override key
all groups carry; where a group's learning-rate bounds changed since the save, the release's keys
without ``max_lr`` / ``min_lr``. Either only if it then gives every current group exactly one saved
group; otherwise the release's matching (with a warning where groups stay alike). A group matched
without its learning-rate bounds comes back with the saved ones, as before 0.19; the scheduler sets
them (``--override-opt-param-scheduler``: the run's, with scheduler-override-group-lr;
``--use-checkpoint-opt-param-scheduler``: the checkpoint's). Replaced: ``DistributedOptimizer.load_state_dict``
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
        "A resumed optimizer gives each parameter group its own saved group (--decoupled-lr: groups alike "
        "but for max_lr took one saved group; 0.19: a changed --lr found none and the load stopped)"
    ),
    affected=">=0.16.0,<=0.19.2",
    upstream=(
        "(a) fixed in Megatron-Core 0.19.0 (param_group_identifier_keys include every ParamGroupOverride key)",
        "(b) NVIDIA/Megatron-LM#3720 (main: the groups' learning rates set after the load)",
    ),
    targets=(
        Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),
        Target(DISTRIB_MODULE, f"{__name__}.runtime.core:probe_distrib", f"{__name__}.runtime.core:apply_distrib"),
    ),
)
