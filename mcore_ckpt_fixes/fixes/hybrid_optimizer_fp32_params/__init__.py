"""hybrid-optimizer-fp32-params: ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) loads a
checkpoint when some of its parameters are already fp32.

Affected: Megatron-Core 0.12.0-0.19.2 (not fixed upstream as of 0.19.2). ``get_megatron_optimizer``
builds the hybrid optimizer with ``param_update_in_fp32=True`` (the distributed optimizer rebuilds it
on its shards): every parameter that is not fp32 gets an fp32 copy, mapped in
``param_to_fp32_param``; an fp32 parameter gets none and is updated itself (or its CPU copy). After a
load, the ``load_state_dict`` post hook (and the distributed optimizer's parameter-state loads) call
``_sync_hdo_state_to_sub_optimizers``, whose ``_update_fp32_params_by_new_state`` looks up *every*
parameter of the state in that map: the first fp32 parameter stops the load with ``KeyError``. An
fp32 model (Megatron-LM without ``--bf16``/``--fp16``) cannot resume at all with
``--optimizer-cpu-offload``; a model that keeps some parameters in fp32 beside bf16 ones neither.

How (runtime/core.py): the release's ``_update_fp32_params_by_new_state`` runs on the parameters
that have an fp32 copy (each copy takes the loaded ``master_param``, as before); a parameter without
one keeps what the load restored, as it is what the optimizer updates. Nothing changes on disk and
nothing is read that the release does not read.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
