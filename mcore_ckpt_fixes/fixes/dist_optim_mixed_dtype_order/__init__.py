"""dist-optim-mixed-dtype-order: the distributed optimizer's checkpoint pairs each parameter with its
own optimizer state when fp32 parameters sit beside bf16/fp16 ones in one parameter group.

Affected: Megatron-Core 0.12.0-0.19.2 (the same code in every release; not reported upstream as of
0.19.2). ``DistributedOptimizer._build_optimizer_group_ranges`` numbers each group's parameters in
gradient-buffer order (``model_param_group_index_map``: parameter -> (group, order)), while
``_build_model_and_main_param_groups`` gives the optimizer's group the fp32 parameters' shards first,
then the 16-bit parameters' fp32 copies. Every checkpoint path (``_get_main_param_and_optimizer_states``,
``_set_main_param_and_optimizer_states``, the dp_zero gather and scatter) looks a parameter's shard and
state up through that map, so with mixed dtypes in a group (a model not wrapped in ``Float16Module``,
or one that keeps some parameters fp32 after it, e.g. Megatron-Bridge's MiniMax-M3 router weights)
each parameter is paired with another parameter's shard: the save stops with an ``AssertionError`` on
the shard sizes, or, where the two shards have the same size, writes each parameter's main value and
Adam moments under the other's name without an error, which a load in another data-parallel layout
hands to the wrong parameters. Training is not affected (gradients and updates go through the shard
groups, which pair correctly).

How (runtime/core.py): after the release's ``_build_optimizer_group_ranges``, each group's parameters
are put in the order the optimizer's group will hold their shards (fp32 first, each kind in
gradient-buffer order, by the release's own fp32 test) and numbered in that order. The optimizer's
groups and what they hold do not change; a group of one dtype keeps its numbering.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
