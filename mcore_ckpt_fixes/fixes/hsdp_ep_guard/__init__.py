"""hsdp-ep-guard: refuse Megatron-FSDP with HSDP and expert parallelism on Megatron-Core 0.16.

With ``use_megatron_fsdp``, HSDP (``num_distributed_optimizer_instances > 1``) and
``expert_model_parallel_size > 1``, 0.16's ``FullyShardedDataParallel._init_dist_index`` builds no
expert mesh and falls back to the dense data-parallel one: each EP rank's experts are sharded,
reduced and checkpointed as if spread over ranks that hold other experts. Nothing fails; the model
trains and checkpoints wrongly. A guard, not a backport: one ``ValueError`` at setup instead.

Upstream: supported from Megatron-Core 0.17.0 (NVIDIA/Megatron-LM#2800, #2840).
Affected: Megatron-Core 0.16.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hsdp-ep-guard"
MODULE = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"

FIX = Fix(
    id=ID,
    summary="Megatron-FSDP with HSDP and EP > 1 is refused at setup instead of sharding experts on the dense mesh",
    affected=">=0.16.0,<0.17.0",
    upstream=(
        "supported upstream from Megatron-Core 0.17.0 (mcore_fsdp_adapter.py builds an HSDP expert mesh)",
        "NVIDIA/Megatron-LM#2800 ([Dev] Support EP with HSDP: adds HSDP support for expert parallelism in "
        "Megatron-FSDP; its description names NVIDIA/Megatron-LM#2840 as the main-branch PR). This fix does not "
        "backport it: on 0.16 it refuses the combination that PR makes work",
    ),
    targets=(Target(MODULE),),
)
