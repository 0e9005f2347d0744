"""hybrid-optimizer-gpu-step: with ``--optimizer-cpu-offload`` and part of the parameters on the GPU
(``--optimizer-offload-fraction`` below 1), the GPU FusedAdam's step counts on after a resume.

A load puts the checkpoint's ``step`` into the hybrid optimizer's param groups, and before each step
``HybridDeviceOptimizer.step`` copies every key of them into its sub-optimizers: the GPU FusedAdam's
counter is set back to the checkpoint's every time, Adam's bias correction frozen, silently. With
nothing offloaded (fraction 0) ``DistributedOptimizer.state_dict``, which takes the step from the
CPU optimizers, saves none: the resumed FusedAdam counts from 0.

Upstream: not reported as of 0.19.2. Affected: Megatron-Core 0.13.0-0.19.2 (measured on 0.13.1, 0.15.3, 0.16.1-0.19.2).
How: the loaded ``step`` is handed to the sub-optimizers once, then left to them; with no CPU
optimizer's step to save, the GPU FusedAdam's is saved. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-gpu-step"
MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
CLASS = "HybridDeviceOptimizer"
FUNCTION = "_sync_hdo_param_groups_to_sub_optimizers"
DIST_MODULE = "megatron.core.optimizer.distrib_optimizer"
DIST_CLASS = "DistributedOptimizer"

FIX = Fix(
    id=ID,
    summary=(
        "--optimizer-cpu-offload with --optimizer-offload-fraction below 1: the GPU FusedAdam's step counts "
        "on after a resume, where every step set it back to the checkpoint's (bias correction frozen), and "
        "with fraction 0 the checkpoint holds its step, where none was saved"
    ),
    affected=">=0.13.0,<=0.19.2",
    upstream=("not reported upstream as of Megatron-Core 0.19.2",),
    targets=(Target(MODULE), Target(DIST_MODULE, "probe_state_dict")),
)
