"""rerun-state-constant-structure: a checkpoint saved with ``--ckpt-assume-constant-structure`` keeps the
rerun state machine's state.

Affected: Megatron-Core 0.14.0 - 0.17.1. Fixed upstream in 0.18.0 (NVIDIA/Megatron-LM#4378,
NVIDIA/Megatron-LM#4448).

Failure prevented: ``RerunStateMachine.state_dict`` returns None while no rerun is pending
(``NOT_RUNNING_YET``), so every steady-state checkpoint has no ``rerun_state_machine`` entry. Under
``--ckpt-assume-constant-structure`` ``save_checkpoint`` keeps its ``TorchDistSaveShardedStrategy``
and reuses the first save's DCP plan and metadata for every later save. When result validation
(``--rerun-mode validate_results``) then finds a fault that must be rerun on another GPU, the
machine asks for a checkpoint and exit; that save's ``rerun_state_machine_state`` (the failed call,
the initial result, the suspicious node and device, the data iterators' replay buffers, the
requests) is not in the cached plan and is not written, silently, while its common part (state
``WILL_RERUN_FROM_CHECKPOINT``) is. The resume then cannot restore the machine.

How: while a machine that can rerun (mode not ``disabled``) saves ``torch_dist`` with no rerun
pending, ``state_dict`` returns the same structure as at a fault (the release's own
``force=True`` state, no data iterator: the requests and fault fields at their defaults), so the
first save's plan covers the fault-time save. On load the release ignores that entry
(``validate_state_dict`` rejects ``NOT_RUNNING_YET``), as 0.18.0 does, which writes the same
structure: checkpoints move between this fix, the unfixed releases and 0.18+ in every direction.
Other formats, the ``disabled`` mode and a pending rerun go through the release's code unchanged.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
