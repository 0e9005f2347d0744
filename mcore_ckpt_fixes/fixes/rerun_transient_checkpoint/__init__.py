"""rerun-transient-checkpoint: the checkpoint Megatron-Core saves when result validation finds a
transient fault resumes training instead of crashing the resumed job.

Affected: Megatron-Core 0.12.0 - 0.17.1. Fixed upstream in 0.18.0 (NVIDIA/Megatron-LM#3981,
NVIDIA/Megatron-LM#3884), which saves no checkpoint at that exit.

Failure prevented: with ``--rerun-mode validate_results``, a rejected result (NaN/Inf, spiky loss)
is rerun in place; when the rerun gives a different result (a transient fault) and the validation
is fatal, the machine stays in ``RERUNNING_IN_PLACE`` and ``should_checkpoint_and_exit`` asks for a
checkpoint and exit (code 17, "A checkpoint at the last iteration is being saved"). That checkpoint
holds the state ``RERUNNING_IN_PLACE`` but not the in-memory RNG snapshot of the step
(``saved_state``, never saved). A job resumed from it (the scheduler takes the latest checkpoint)
restores the state, and its first ``should_run_forward_backward`` restores that snapshot:
``TypeError: 'NoneType' object is not subscriptable`` in ``_restore_state``, on every rank.

How: once the release has asked for the checkpoint at a transient fault, the machine has nothing
left to rerun: it goes back to ``NOT_RUNNING_YET`` before the save, so the checkpoint is a regular
one (the model before the faulty step's update, the step's RNG and data position) that every release
resumes from, rerunning the step as a normal one. A rerun state with ``RERUNNING_IN_PLACE`` that an
unfixed release wrote is ignored on load, with a ``MegatronPatchWarning``, for the same reason.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
