"""hybrid-optimizer-fp32-params: ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) loads a
checkpoint when some of its parameters are already fp32.

The hybrid optimizer gives every parameter that is not fp32 an fp32 copy (``param_to_fp32_param``);
an fp32 parameter gets none. After a load, ``_update_fp32_params_by_new_state`` looks up *every*
parameter in that map: the first fp32 parameter stops the load with ``KeyError``. An fp32 model, or
one that keeps fp32 parameters beside bf16 ones, cannot resume with ``--optimizer-cpu-offload``.

Upstream: not fixed as of 0.19.2 (worked around in NovaSky-AI/SkyRL#1403).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-fp32-params"
MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "HybridDeviceOptimizer (--optimizer-cpu-offload) loads a checkpoint when some parameters are "
        "already fp32 (the load raised KeyError for each parameter without an fp32 copy)"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py)",
        "NovaSky-AI/SkyRL#1403 (worked around there)",
    ),
    targets=(Target(MODULE),),
)
