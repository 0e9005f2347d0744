"""dist-optim-mixed-dtype-order: the distributed optimizer's checkpoint pairs each parameter with its
own optimizer state when fp32 parameters sit beside bf16/fp16 ones in one parameter group.

The checkpoint paths find a parameter's shard and state through ``model_param_group_index_map``,
numbered in gradient-buffer order, while the optimizer's group holds the fp32 parameters' shards
first. With mixed dtypes in a group each parameter is paired with another's shard: the save stops
with an ``AssertionError`` on the shard sizes or, where the sizes agree, writes each parameter's main
value and Adam moments under the other's name, which a load in another data-parallel layout hands to
the wrong parameters, silently.

Upstream: NVIDIA/Megatron-LM#5835 (fixed on the dev branch; in no release up to 0.19.2).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dist-optim-mixed-dtype-order"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "The distributed optimizer saves and loads each parameter's own state when fp32 parameters sit "
        "beside bf16/fp16 ones in a parameter group (AssertionError on save, or the state of equal-sized "
        "parameters swapped)"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#5835: fixed on upstream's dev branch (ceaa6c5d7e: the map renumbered in "
        "DistributedOptimizer.__init__), in no release up to 0.19.2",
    ),
    targets=(Target(MODULE),),
)
