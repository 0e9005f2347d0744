"""rerun-state-strict-load: a ``torch_dist`` checkpoint whose rerun state the load deliberately
ignores loads under every ``--dist-ckpt-strictness``.

A checkpoint saved while the rerun state machine can rerun carries ``rerun_state_machine_state``;
``load_checkpoint`` leaves it out of the request on purpose unless a rerun is to be restored. The
strictness values that compare the request with the whole checkpoint (``raise_all``, ``log_all``,
``return_all``, ``ignore_all``) count it as forgotten: with ``raise_all`` every rank stops with
``CheckpointingException: ... Missing keys (for all ranks): {'rerun_state_machine_state'}``.

Upstream: NVIDIA/Megatron-LM#7428, PR #7222 (both open).
Affected: Megatron-Core 0.12.0-0.19.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "rerun-state-strict-load"
MODULE = "megatron.core.dist_checkpointing.validation"
FUNCTION = "_determine_missing_and_unexpected_keys"
RERUN_KEY = "rerun_state_machine_state"

FIX = Fix(
    id=ID,
    summary="strict loads (raise_all and the other *_all values) accept the rerun state a load ignores on purpose",
    affected=">=0.12.0,<0.20",
    upstream=(
        "NVIDIA/Megatron-LM#7428: strict loading rejects checkpoints with idle rerun state (open)",
        "NVIDIA/Megatron-LM#7222: fix proposed upstream (open)",
    ),
    targets=(Target(MODULE),),
)
