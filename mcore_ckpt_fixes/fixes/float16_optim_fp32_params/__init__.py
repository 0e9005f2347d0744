"""float16-optim-fp32-params: the non-distributed mixed-precision optimizer saves and loads when some
of its parameters are fp32.

``Float16OptimizerWithFloat16Params`` (bf16/fp16 without ``--use-distributed-optimizer``) keeps each
16-bit parameter's fp32 copy in its groups and an fp32 parameter itself, in the group's order. Its
``sharded_state_dict`` numbers the optimizer's state from the 16-bit parameters alone, while torch
numbers every parameter of every group: with an fp32 parameter in a group the save stops with
``ValueError: Param id N does not match any model sharded param`` (or, where the shapes agree, gives
a parameter another's state).

Upstream: NVIDIA/Megatron-LM#5929 (fixed on main, 86e928a97f; in no release up to 0.19.2).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "float16-optim-fp32-params"
MODULE = "megatron.core.optimizer.optimizer"
CLASS = "Float16OptimizerWithFloat16Params"
METHOD = "sharded_state_dict"

FIX = Fix(
    id=ID,
    summary=(
        "the non-distributed mixed-precision optimizer (Float16OptimizerWithFloat16Params) saves and loads "
        "with fp32 parameters in its groups (the save raised 'Param id N does not match any model sharded param')"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=("NVIDIA/Megatron-LM#5929 (fixed on main, 86e928a97f; in no release up to 0.19.2)",),
    targets=(Target(MODULE),),
)
