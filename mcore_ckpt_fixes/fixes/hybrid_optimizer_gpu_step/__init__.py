"""hybrid-optimizer-gpu-step: with ``--optimizer-cpu-offload`` and part of the parameters on the GPU
(``--optimizer-offload-fraction`` below 1), the GPU FusedAdam's step counts on after a resume.

A load puts the checkpoint's ``step`` into the hybrid optimizer's param groups (where Transformer
Engine's and Apex's FusedAdam keep it). ``HybridDeviceOptimizer.step`` copies every key of those
groups into its sub-optimizers before each step, ``step`` included, so the GPU FusedAdam's counter
is set back to the checkpoint's before every step: Adam's bias correction stays frozen at the first
resumed step for the rest of the run, silently. (The CPU optimizers, torch's AdamW, count per
parameter and are not affected.)

Upstream: not reported as of 0.19.2. Affected: Megatron-Core 0.13.0-0.19.2 (measured on 0.13.1, 0.15.3, 0.16.1-0.19.2).
How: the loaded ``step`` is handed to the sub-optimizers once, then left to them. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-gpu-step"
MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
CLASS = "HybridDeviceOptimizer"
FUNCTION = "_sync_hdo_param_groups_to_sub_optimizers"

FIX = Fix(
    id=ID,
    summary=(
        "--optimizer-cpu-offload with --optimizer-offload-fraction below 1: the GPU FusedAdam's step counts "
        "on after a resume, where every step set it back to the checkpoint's (bias correction frozen)"
    ),
    affected=">=0.13.0,<=0.19.2",
    upstream=("not reported upstream as of Megatron-Core 0.19.2",),
    targets=(Target(MODULE),),
)
