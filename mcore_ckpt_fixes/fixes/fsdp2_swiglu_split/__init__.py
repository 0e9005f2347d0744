"""fsdp2-swiglu-split: a SwiGLU ``linear_fc1`` sharded by torch FSDP2 is written to ``torch_dist``
checkpoints with its gate (W) and up (V) halves in their places.

With ``--use-torch-fsdp2`` each rank holds a slice of rows of the TP-local ``[W; V]`` weight, and
``apply_swiglu_sharded_factory`` cuts that *slice* in two, labelling its halves W and V. The save and
a resume in the same layout are exact (the same wrong map both ways), but the checkpoint's global
``linear_fc1`` (weight, bias, Adam moments) is scrambled: loading it unsharded, with another
data-parallel size or by a converter gives every such MLP mixed gate and up rows, silently.

Upstream: NVIDIA/Megatron-LM#5714 (0.19.0 maps an FSDP2 shard inside ``[W; V]``).
Affected: Megatron-Core 0.12.0-0.18.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "fsdp2-swiglu-split"
MODULE = "megatron.core.transformer.mlp"

FIX = Fix(
    id=ID,
    summary=(
        "torch FSDP2 (DTensor) SwiGLU linear_fc1: the checkpoint keeps W and V rows in their places "
        "(the release split each DP shard in two, scrambling the global tensor silently)"
    ),
    affected=">=0.12.0,<0.19.0",
    upstream=(
        "NVIDIA/Megatron-LM#5714 (Megatron-Core 0.19.0: apply_swiglu_sharded_factory takes the data-parallel "
        "group and maps an FSDP2 DP shard inside [W; V])",
    ),
    targets=(Target(MODULE),),
)
