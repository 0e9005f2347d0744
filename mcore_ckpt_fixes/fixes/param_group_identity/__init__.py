"""param-group-identity: a resumed optimizer gives each parameter group its own saved group, also
when the run's learning rate changed since the save.

A load matches saved parameter groups to the optimizer's by ``param_group_identifier_keys``. (a) On
0.16.0-0.18.x they omit the group overrides (``max_lr``, ``min_lr``, ...), so groups that differ only
in one (``--decoupled-lr``) take the same saved group and one resumes with the other's learning
rates, silently. (b) On 0.19.x they hold ``max_lr`` / ``min_lr``, so a run resumed with a changed
``--lr`` finds no saved group and ``load_checkpoint`` stops (``KeyError`` / ``ValueError``).

Upstream: (a) fixed in 0.19.0; (b) NVIDIA/Megatron-LM#3720 on main.
Affected: Megatron-Core 0.16.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
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
        Target(MODULE),
        Target(DISTRIB_MODULE, "probe_distrib", "apply_distrib"),
    ),
)
