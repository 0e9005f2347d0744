"""hybrid-optimizer-fp32-shards: ``--optimizer-cpu-offload`` (``HybridDeviceOptimizer``) with the
distributed optimizer builds, and trains, when the model has fp32 parameters.

The distributed optimizer gives its optimizer each fp32 parameter's shard as a view of the parameter
(``model_param.view(-1)[range]``), a non-leaf tensor; with the hybrid optimizer,
``DistributedOptimizer.__init__`` rebuilds it over those shards through torch's ``Optimizer``
constructor, which refuses them: ``ValueError: can't optimize a non-leaf Tensor``. An fp32 model, or
fp32 parameters beside bf16 ones, cannot train with ``--optimizer-cpu-offload``.

Upstream: NVIDIA/Megatron-LM#6212 (reported), #7013 (the same change proposed); neither in 0.19.2.
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
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
    targets=(Target(MODULE),),
)
