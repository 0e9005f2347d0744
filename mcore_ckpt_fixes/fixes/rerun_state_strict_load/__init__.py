"""rerun-state-strict-load: a ``torch_dist`` checkpoint whose rerun state the load deliberately
ignores loads under every ``--dist-ckpt-strictness``.

Affected: Megatron-Core 0.12.0 - 0.19.2 (open upstream: NVIDIA/Megatron-LM#7428, PR #7222).

Failure prevented: a checkpoint saved while the rerun state machine can rerun carries the sharded
entry ``rerun_state_machine_state`` (0.12-0.13 always, 0.18+ in steady state, 0.14-0.17 at a fault
or with rerun-state-constant-structure). ``load_checkpoint`` asks for it only when a rerun is to be
restored (``validate_state_dict`` accepts the saved state, same topology, no ``--finetune``); in every
other case it leaves the entry out of the request on purpose. The strictness values that compare
the request with the whole checkpoint (``raise_all``, ``log_all``, ``return_all``, ``ignore_all``)
then count it as a key the user forgot: with ``raise_all`` every rank stops in ``load_checkpoint``
with ``CheckpointingException: ... Missing keys (for all ranks): {'rerun_state_machine_state'}``.

How: dist_checkpointing's mismatch check leaves ``rerun_state_machine_state`` out of the missing
keys when no rank asks for it, as the release already does for its own ``common_state`` entry. A
load that asks for the entry (a pending rerun) is unchanged; nothing more is read from the
checkpoint than the release reads; the unexpected keys are the release's.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
