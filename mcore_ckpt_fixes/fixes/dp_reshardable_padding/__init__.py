"""dp-reshardable-padding: the distributed optimizer saves and loads in ``dp_reshardable`` format
(Megatron-LM's default) whatever part of a bucket's end padding a data-parallel rank holds.

``DistributedOptimizer.sharded_param_state_dp_reshardable`` describes a rank's shard of a bucket as
parameter pieces plus padding pieces. A rank whose shard holds no parameter stops with
``AssertionError: empty bucket encountered`` while its peers wait in the save's collectives; a rank
whose shard ends past the bucket's unpadded size (tied embeddings or MTP with PP > 1) describes
padding past the checkpoint tensor, and torch DCP rejects the plan after the other ranks wrote their
files, leaving an iteration directory without metadata.

Upstream: NVIDIA/Megatron-LM#6191 and #5898 (both open).
Affected: Megatron-Core 0.15.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dp-reshardable-padding"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "The distributed optimizer saves dp_reshardable (Megatron-LM's default) when a rank's shard of a "
        "bucket is all padding or ends past the bucket's unpadded size (was an AssertionError, or a DCP "
        "plan error that left a partial checkpoint)"
    ),
    affected=">=0.15.0,<=0.19.2",
    upstream=("NVIDIA/Megatron-LM#6191 (open)", "NVIDIA/Megatron-LM#5898 (open)"),
    targets=(Target(MODULE),),
)
