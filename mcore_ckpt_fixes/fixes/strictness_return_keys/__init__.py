"""strictness-return-keys: ``--dist-ckpt-strictness return_unexpected`` / ``return_all`` loads.

With those values ``dist_checkpointing.load`` hands the caller the keys that do not match the
checkpoint: it returns ``(state dict, missing keys, unexpected keys)``. ``megatron.training``'s
``_load_global_dist_base_checkpoint`` passes that tuple on as the state dict, and every rank stops in
``load_checkpoint`` with ``AttributeError: 'tuple' object has no attribute 'get'``. The fix hands on
the state dict and logs the keys (WARNING, one line on each rank that has any), as ``log_unexpected``
/ ``log_all`` would report them.

Upstream: not reported for megatron.training; NVIDIA-NeMo/Megatron-Bridge#6053 (the same tuple there).
Affected: Megatron-Core 0.17.0-0.19.2 (``megatron/training`` ships in the wheel from 0.17.0; a
checkout of an older release is decided by the probe). The rest is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "strictness-return-keys"
MODULE = "megatron.training.checkpointing"
FUNCTION = "_load_global_dist_base_checkpoint"

FIX = Fix(
    id=ID,
    summary=(
        "--dist-ckpt-strictness return_unexpected / return_all load: the state dict is handed on and the "
        "mismatching keys logged, where every rank stopped on the returned tuple"
    ),
    affected=">=0.17.0,<=0.19.2",
    upstream=(
        "not reported for megatron.training (public issues searched for the error message)",
        "NVIDIA-NeMo/Megatron-Bridge#6053: the same returned tuple in Megatron-Bridge's load paths (open)",
    ),
    targets=(Target(MODULE),),
)
