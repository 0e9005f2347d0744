"""hybrid-optimizer-fp32-shards: ``--optimizer-cpu-offload`` (``HybridDeviceOptimizer``) with the
distributed optimizer builds, and trains, when the model has fp32 parameters.

Affected: Megatron-Core 0.12.0-0.19.2 (not in a release as of 0.19.2; NVIDIA/Megatron-LM#6212
reports it, #7013 proposes the same change). ``DistributedOptimizer._build_model_and_main_param_groups``
gives the optimizer each fp32 parameter's shard as a view of the parameter
(``model_param.view(-1)[range]``), which autograd tracks as a non-leaf tensor; with the hybrid
optimizer, ``DistributedOptimizer.__init__`` then rebuilds it over those shards through torch's
``Optimizer`` constructor, which refuses them: ``ValueError: can't optimize a non-leaf Tensor``. An
fp32 model, or fp32 parameters beside bf16 ones, cannot train with ``--optimizer-cpu-offload``.

How (runtime/core.py): with ``optimizer_cpu_offload``, each fp32 shard is the same view taken of the
detached parameter: it shares the parameter's storage, so what the optimizer writes into it is the
parameter's value, and it is one object in the distributed optimizer's shard groups and the
optimizer's parameter groups, so the gradient the distributed optimizer hands it
(``decoupled_grad``) is the one the optimizer reads. Nothing changes without cpu offload.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-fp32-shards"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "--optimizer-cpu-offload with the distributed optimizer builds and trains a model with fp32 "
        "parameters (building the optimizer raised ValueError: can't optimize a non-leaf Tensor)"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#6212 (fp32 parameters with --optimizer-cpu-offload; closed)",
        "NVIDIA/Megatron-LM#7013 (detach the fp32 shard view; closed, not in a release as of 0.19.2)",
    ),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
