"""remove-sharded-tensors: ``dist_checkpointing.remove_sharded_tensors`` drops tensors from a
``torch_dist`` checkpoint instead of failing.

The public call that drops tensors by key prefix (the optimizer state, say) from a checkpoint saved
with a ``separation_hint`` fails with ``AttributeError``: on 0.17-0.18 it calls a method that
``TorchDistSaveShardedStrategy`` does not have; on 0.12-0.18 the strategy's implementation renames
``FileSystemWriter.metadata_path``, which torch's writer no longer has, after writing ``.metadata.tmp``.

Upstream: NVIDIA/Megatron-LM#5759 (fixed in 0.19.0).
Affected: Megatron-Core 0.12.0-0.18.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "remove-sharded-tensors"
MODULE = "megatron.core.dist_checkpointing.strategies.torch"
SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
CLASS = "TorchDistLoadShardedStrategy"
FUNCTION = "remove_sharded_tensors"

FIX = Fix(
    id=ID,
    summary=(
        "dist_checkpointing.remove_sharded_tensors drops the tensors of a key prefix from a torch_dist checkpoint "
        "(it failed with AttributeError: the save strategy's missing method, FileSystemWriter.metadata_path)"
    ),
    affected=">=0.12.0,<0.19.0",
    upstream=("NVIDIA/Megatron-LM#5759 (fixed in 0.19.0)",),
    targets=(
        Target(MODULE, alias_sites=()),
        # The public call asks the save strategy on 0.17-0.18 only (0.12-0.16 its load strategy).
        Target(
            SERIALIZATION,
            probe="probe_serialization",
            alias_sites=("megatron.core.dist_checkpointing",),
            affected=">=0.17.0,<0.19.0",
        ),
    ),
)
