"""hybrid-optimizer-dp-zero-load: under ``--optimizer-cpu-offload`` a resume from the legacy ``torch``
format (the distributed optimizer's state through DP rank 0) trains on the loaded weights.

``DistributedOptimizer.load_state_dict`` runs ``HybridDeviceOptimizer.dummy_step`` on a fresh
optimizer: a real step on random gradients, whose post-step hooks copy the optimizer's copies (of
the fresh job's weights) into the model just loaded. ``load_parameter_state_from_dp_zero`` then puts
the saved master parameters into the hybrid optimizer's state only, not its sub-optimizers'. The
resumed model holds the initial weights plus a random step, silently.

Upstream: not reported as of 0.19.2. Affected: Megatron-Core 0.16.0-0.19.2 (measured; 0.12-0.15 read).
How: the dummy step leaves the parameters as it found them; the dp_zero load hands the loaded state
to the sub-optimizers, as the release's other loads do. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-dp-zero-load"
MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
CLASS = "HybridDeviceOptimizer"
FUNCTION = "dummy_step"
DIST_MODULE = "megatron.core.optimizer.distrib_optimizer"
DIST_CLASS = "DistributedOptimizer"
DP_ZERO = "load_parameter_state_from_dp_zero"

FIX = Fix(
    id=ID,
    summary=(
        "--optimizer-cpu-offload, resume from the legacy torch format: the model keeps the loaded weights "
        "and the hybrid optimizer steps the loaded master parameters, where the model was overwritten "
        "with the fresh job's initial weights plus a random step"
    ),
    affected=">=0.16.0,<=0.19.2",
    upstream=("not reported upstream as of Megatron-Core 0.19.2",),
    targets=(Target(MODULE), Target(DIST_MODULE, "probe_dp_zero")),
)
