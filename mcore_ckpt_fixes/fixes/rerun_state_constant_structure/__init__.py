"""rerun-state-constant-structure: a checkpoint saved with ``--ckpt-assume-constant-structure`` keeps the
rerun state machine's state.

``RerunStateMachine.state_dict`` returns None while no rerun is pending, so steady-state checkpoints
have no ``rerun_state_machine`` entry, and ``--ckpt-assume-constant-structure`` reuses the first
save's plan. When result validation then asks for a checkpoint and exit to rerun a fault, that save's
sharded rerun state is not in the cached plan and is not written, silently; the resume stops with
``Missing key in checkpoint state_dict: rerun_state_machine_state/...``.

Upstream: NVIDIA/Megatron-LM#4378, #4448 (fixed in 0.18.0).
Affected: Megatron-Core 0.14.0-0.17.1.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "rerun-state-constant-structure"
MODULE = "megatron.core.rerun_state_machine"

FIX = Fix(
    id=ID,
    summary="rerun state machine's state has one structure in every torch_dist save: a cached save plan keeps it",
    affected=">=0.14.0,<0.18.0",
    upstream=(
        "NVIDIA/Megatron-LM#4378: with --ckpt-assume-constant-structure the fault-time save drops "
        "rerun_state_machine_state",
        "NVIDIA/Megatron-LM#4448: state_dict keeps a constant structure (Megatron-Core 0.18.0)",
    ),
    targets=(Target(MODULE),),
)
