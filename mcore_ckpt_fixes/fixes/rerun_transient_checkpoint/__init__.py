"""rerun-transient-checkpoint: the checkpoint Megatron-Core saves when result validation finds a
transient fault resumes training instead of crashing the resumed job.

With ``--rerun-mode validate_results``, a transient fault under fatal validation leaves the machine
in ``RERUNNING_IN_PLACE`` and asks for a checkpoint and exit (code 17). That checkpoint holds the
state but not the step's in-memory RNG snapshot, so a job resumed from it stops in its first step
with ``TypeError: 'NoneType' object is not subscriptable`` in ``_restore_state``, on every rank.

Upstream: NVIDIA/Megatron-LM#3884, #3981 (0.18.0 saves no checkpoint at that exit).
Affected: Megatron-Core 0.12.0-0.17.1.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "rerun-transient-checkpoint"
MODULE = "megatron.core.rerun_state_machine"

FIX = Fix(
    id=ID,
    summary="the checkpoint saved at a transient fault resumes training instead of crashing the resumed job",
    affected=">=0.12.0,<0.18.0",
    upstream=(
        "NVIDIA/Megatron-LM#3884: a job resumed from the checkpoint saved at a transient fault (exit "
        "code 17) crashes with TypeError: 'NoneType' object is not subscriptable",
        "NVIDIA/Megatron-LM#3981: no checkpoint at that exit (Megatron-Core 0.18.0)",
    ),
    targets=(Target(MODULE),),
)
