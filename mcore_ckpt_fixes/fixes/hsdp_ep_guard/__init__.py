"""hsdp-ep-guard: refuse Megatron-FSDP with HSDP and expert parallelism on Megatron-Core 0.16.

Affected: Megatron-Core 0.16.x. Upstream 0.17.0 builds an expert device mesh for HSDP
(``FullyShardedDataParallel._init_dist_index`` in ``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py``
reads the partial expert-data-parallel groups and passes ``expt_device_mesh`` / ``hybrid_fsdp_expt_group``
to ``FSDPDistributedIndex``). This is a guard, not a backport.

Failure prevented: with ``use_megatron_fsdp``, ``num_distributed_optimizer_instances > 1`` (HSDP) and
``expert_model_parallel_size > 1``, 0.16's ``_init_dist_index`` takes its HSDP branch, which never
looks at the expert groups: ``FSDPDistributedIndex`` gets no expert mesh and falls back to the dense
data-parallel mesh, so each EP rank's experts are sharded (and gradients reduced, and checkpoints
described) as if they were one tensor spread over ranks that hold *other* experts. Nothing fails; the
model trains and checkpoints wrongly. The guard raises one clear ``ValueError`` at setup instead, in
``FullyShardedDataParallel.__init__`` (its first step builds the meshes), naming the settings and what
is accepted. Every other configuration goes through the original code untouched.

0.16 wheels do not ship ``megatron/training``: the guard sits in ``megatron.core`` (the adapter every
Megatron-FSDP user of 0.16, Megatron-LM's training loop included, constructs).

Layout: ``runtime/core.py`` holds the probe, the replacement method and the guard's message
(``refusal``, which the diff imports); ``diff/core.py`` the source edit of ``patches/hsdp-ep-guard/``;
``checks/`` the 4-rank round trip (``scenarios.py``, ``core.py``).
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
