"""gdn-fsdp-split: fsdp_dtensor save of Gated-DeltaNet fused projections, rank-consistent, no collectives.

On 0.18.x ``handle_gdn_in_state_dict`` splits a fused ``in_proj`` / ``conv1d`` that is already
TP-local (as Megatron-Bridge and verl hand it over) by TP a second time, and the save stops with
``DTensor chunk metadata boundary check failed``; a plain-Tensor optimizer state stops in
``to_local()``. 0.19.x chooses a fast path per rank whose collectives differ from the other
branch's: ranks holding different layouts hang, and for TP-local tensors both TP ranks write the same
chunk, so one TP rank loads the other's values.

Upstream: NVIDIA/Megatron-LM#4748/#4753/#4799/#4843 (0.19 fast path), #4423, #4910 (the hang).
Affected: Megatron-Core 0.18.0-0.19.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "gdn-fsdp-split"
MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
NAME = "handle_gdn_in_state_dict"

# Modules known to bind the function by name (the engine rebinds every loaded module anyway).
ALIAS_SITES = ("megatron.bridge.training.checkpointing",)

FIX = Fix(
    id=ID,
    summary="fsdp_dtensor save of Gated-DeltaNet fused projections: TP split applied twice (0.18), "
    "per-rank fast path with mismatched collectives (0.19); replaced by a collective-free split",
    affected=">=0.18.0,<0.20.0",
    upstream=(
        "NVIDIA/Megatron-LM#4748/#4753/#4843 (0.19 fast path for TP-local GDN tensors)",
        "NVIDIA/Megatron-LM#4910 (hang when ranks take different branches)",
        "NVIDIA/Megatron-LM#4423 (plain-Tensor optimizer states)",
    ),
    targets=(Target(MODULE, alias_sites=ALIAS_SITES),),
)
