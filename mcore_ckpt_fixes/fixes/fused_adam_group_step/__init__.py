"""fused-adam-group-step: a FusedAdam parameter group saved without its step resumes on the step.

Affected: Megatron-Core 0.12.0-0.19.2 (upstream: NVIDIA/Megatron-LM#2016, open).

Failure prevented: up to 0.13.1 the distributed optimizer saves the param groups of one rank (DP
rank 0, or global rank 0) as Apex's / Transformer Engine's FusedAdam holds them; a group empty on
that rank has never stepped there and is saved without a ``step``. Every rank that holds parameters
of it resumes that group on step 1 (Adam's bias correction restarts, silently); from 0.14 the
first save after such a resume stops with ``AssertionError: steps: [N+M, M]``.

How: before the release's load, a saved group without a step takes the one step every other saved
group of the optimizer has. The rest is on the page, doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "fused-adam-group-step"
MODULE = "megatron.core.optimizer.distrib_optimizer"
FUNCTION = "load_state_dict"

FIX = Fix(
    id=ID,
    summary=(
        "A distributed-optimizer checkpoint whose FusedAdam param group was saved without its step (by "
        "Megatron-Core <= 0.13, from a rank where the group is empty) resumes that group on the step "
        "the others have: no restart of Adam's bias correction, no `steps: [N+M, M]` at the next save"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#2016 (open): a pre-0.14 checkpoint resumed on 0.14/0.15, the next save "
        "stops with AssertionError: steps",
    ),
    targets=(Target(MODULE),),
)
