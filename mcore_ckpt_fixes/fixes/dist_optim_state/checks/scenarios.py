"""dist-optim-state's round trips as the suite and ``selftest`` find them (no torch, no Megatron here).

World 2 (DP=2), Megatron's DDP and distributed optimizer, ``dist_checkpointing``, requests built as
third-party trainers build them (see checks/core.py). Each scenario is one case of ``core.CASES``;
tests/fixes/test_dist_optim_state.py runs them all (and the other cases) in one world per half.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID, MODULE

_CORE = f"{__package__}.core"
_PREPARE = f"{_CORE}:prepare"
_DP_RESHARDABLE = f"{MODULE}:DistributedOptimizer.sharded_param_state_dp_reshardable"
# (a): the load completes; the check finds no moments restored (the release says nothing).
MOMENTS_LOST_BUG = Bug.raises("moments", "AssertionError: the load restored no exp_avg, exp_avg_sq")
# (b)
NO_METADATA_BUG = Bug.raises("save", "CheckpointingException: ShardedTensor.flattened_range is not supported.")
# (c)
FP32_LOAD_BUG = Bug.raises(
    "load", "RuntimeError: a view of a leaf Variable that requires grad is being used in an in-place operation."
)

SCENARIOS = (
    Scenario(
        ID,
        "fresh_request",
        f"{_CORE}:fresh_request",
        2,
        {">=0.12.0,<=0.19.2": MOMENTS_LOST_BUG},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        alongside=("numpy2-product",),  # before 0.15 the model-space save calls numpy's product
        doc="load request built with is_loading=False on a fresh distributed optimizer (FusedAdam path, "
        "dp_reshardable; model space before 0.15)",
    ),
    Scenario(
        ID,
        "no_metadata",
        f"{_CORE}:no_metadata",
        2,
        {">=0.16.0,<=0.19.2": NO_METADATA_BUG},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        requires=(_DP_RESHARDABLE,),
        applicable=f"{_CORE}:default_format_unsavable",
        doc="save and load requests built with sharded_state_dict(model_sd), no metadata",
    ),
    Scenario(
        ID,
        "fp32_load",
        f"{_CORE}:fp32_load",
        2,
        {">=0.15.0,<=0.19.2": FP32_LOAD_BUG},
        batch=f"{_CORE}:cases",
        prepare=_PREPARE,
        requires=(f"{MODULE}:DistributedOptimizer.load_parameter_state_from_dp_reshardable",),
        doc="fp32 model (no bf16) loaded from dp_reshardable outside torch.no_grad()",
    ),
)
