"""dist-optim-state: the distributed optimizer checkpoints its whole state from the calls trainers make.

Trainers that build their own save and load requests (AReaL, verl, SkyRL, slime) meet three defects
of ``DistributedOptimizer``: (a) a load request built without ``is_loading=True`` on a never-stepped
optimizer restores no Adam moments, silently; (b) ``sharded_state_dict`` without ``metadata``
defaults to a format every save and load refuses from 0.16.0 (``ShardedTensor.flattened_range is not
supported``); (c) an fp32 model's ``dp_reshardable`` load outside ``torch.no_grad()`` stops with
``RuntimeError: a view of a leaf Variable that requires grad ...``.

Upstream: not fixed as of 0.19.2 (AReaL#1468; NVIDIA/Megatron-LM#2956, verl#4990, AReaL#1341, SkyRL#1268).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dist-optim-state"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "The distributed optimizer saves and restores its whole state from third-party trainers' calls: "
        "a load request built without is_loading restores the moments, no metadata saves, fp32 loads"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (megatron/core/optimizer/distrib_optimizer.py)",
        "areal-project/AReaL#1468: a load whose optimizer request was built with is_loading=False restores no moments",
        "NVIDIA/Megatron-LM#2956 (open), verl-project/verl#4990, areal-project/AReaL#1341, NovaSky-AI/SkyRL#1268: "
        "ShardedTensor.flattened_range is not supported",
    ),
    targets=(Target(MODULE),),
)
