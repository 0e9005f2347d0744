"""dist-optim-state: the distributed optimizer checkpoints its whole state from the calls trainers make.

Affected: Megatron-Core 0.12.0-0.19.2 (not fixed upstream as of 0.19.2), in
``megatron/core/optimizer/distrib_optimizer.py``. Megatron-LM's own ``save_checkpoint`` /
``load_checkpoint`` call ``DistributedOptimizer.sharded_state_dict`` with ``is_loading`` and a
``metadata`` naming the format; third-party trainers (AReaL, verl, SkyRL, slime) build their save
and load requests themselves and meet three defects:

(a) Silent. ``sharded_state_dict`` allocates the optimizer's state (the Adam moments) only when
    told ``is_loading=True``. A load request built without it on a freshly built optimizer (no
    step taken yet) describes the main parameters and nothing else: the load restores the
    parameters and the step and no ``exp_avg`` / ``exp_avg_sq`` for any parameter, with no error.
    On the FusedAdam path the next step starts the moments from zero and the resumed run diverges
    from then on; ``fully_reshardable`` stops with ``KeyError: 'exp_avg'`` (0.15.0+), as does the
    next step on torch's Adam. (AReaL#1468.)
(b) ``sharded_state_dict(model_sd)`` without ``metadata`` defaults to ``fully_sharded_model_space``,
    whose flattened tensors ``ShardedTensor.validate_metadata_integrity`` has rejected since 0.16.0:
    every save (and load) stops with ``CheckpointingException: ShardedTensor.flattened_range is not
    supported.`` (NVIDIA/Megatron-LM#2956, verl#4990, AReaL#1341, SkyRL#1268.)
(c) An fp32 model (no bf16 / fp16: the main parameters are views of the model's, which require
    grad) loaded from ``dp_reshardable`` outside ``torch.no_grad()``: ``RuntimeError: a view of a
    leaf Variable that requires grad is being used in an in-place operation.`` from
    ``_set_main_param_and_optimizer_states``: ``load_parameter_state_from_dp_reshardable`` is the
    one ``load_parameter_state_from_*`` without ``@torch.no_grad()`` (0.15.0+).

How (runtime/core.py): (a) on an optimizer that has no state yet, a request built with
``is_loading=False`` is described over zero moments (the optimizer's own ``init_state_fn``, the
state Adam starts from), and the optimizer is left as it was (no state), so that a save writes what
a never-stepped Adam holds and a load fills the moments through ``load_state_dict``; (b) a call that
names no format gets ``dp_reshardable``, what Megatron-LM's own ``save_checkpoint`` asks for; (c) the
dp_reshardable load runs under ``torch.no_grad()``. Each wrapper is installed only where the probe
finds its defect, and hands every other call to the release unchanged. Nothing changes on disk
beyond what the request describes.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dist-optim-state"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "The distributed optimizer saves and restores its whole state from third-party trainers' calls: "
        "a load request built without is_loading restores the moments, no metadata saves, fp32 loads"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (megatron/core/optimizer/distrib_optimizer.py)",
        "areal-project/AReaL#1468: a load whose optimizer request was built with is_loading=False restores no moments",
        "NVIDIA/Megatron-LM#2956 (open), verl-project/verl#4990, areal-project/AReaL#1341, NovaSky-AI/SkyRL#1268: "
        "ShardedTensor.flattened_range is not supported",
    ),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
