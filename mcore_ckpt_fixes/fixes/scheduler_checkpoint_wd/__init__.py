"""scheduler-checkpoint-wd: with ``--use-checkpoint-opt_param-scheduler`` the first step after a resume
uses the checkpoint's weight decay, not the one the new arguments give.

``OptimizerParamScheduler.load_state_dict`` sets every param group's lr and weight decay
(``self.step``) before it restores the checkpoint's start_wd / end_wd / wd_incr_steps /
wd_incr_style. A run resumed with changed weight-decay arguments and the checkpoint's schedule
therefore takes its first optimizer step with the new arguments' weight decay, silently; the
scheduler's next step writes the checkpoint's.

Upstream: NVIDIA/Megatron-LM#7468 (open); NVIDIA-NeMo/Automodel#3882, #3883.
Affected: Megatron-Core 0.12.0-0.19.2.
How: the groups' lr and weight decay are set again once the load restored the weight-decay
fields (``step(increment=0)``). The rest is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "scheduler-checkpoint-wd"
MODULE = "megatron.core.optimizer_param_scheduler"
CLASS = "OptimizerParamScheduler"

FIX = Fix(
    id=ID,
    summary="--use-checkpoint-opt_param-scheduler gives the param groups the checkpoint's weight decay from "
    "the first resumed step on",
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#7468 (open): OptimizerParamScheduler.load_state_dict steps the param groups "
        "before it restores the checkpoint's weight-decay settings",
        "NVIDIA-NeMo/Automodel#3882, #3883: the same order in NeMo Automodel's copy of the scheduler",
    ),
    targets=(Target(MODULE),),
)
