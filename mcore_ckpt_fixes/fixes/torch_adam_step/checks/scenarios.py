"""torch-adam-step's round trips as the suite and ``selftest`` find them (no torch, no Megatron here).

World 2 (DP=2), Megatron's DDP and distributed optimizer on torch's Adam, or with CPU offload
(``HybridDeviceOptimizer``), ``dist_checkpointing`` (see checks/core.py). Each scenario is one case of ``core.CASES``; tests/fixes/test_torch_adam_step.py
runs them all (and the fresh fully_reshardable load) in one world per half.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID, MODULE

_CORE = f"{__package__}.core"
_PREPARE = f"{_CORE}:prepare"
# Defect (a): state_dict, called first by sharded_state_dict(is_loading=True), asserts without a message.
FRESH_LOAD_BUG = Bug.raises("load_request", "AssertionError: ")
# Defect (b): the step each parameter had before the load (1: the target took one step) comes back.
STALE_STEP_BUG = Bug.raises("step", "AssertionError: per-parameter step after the load: [1.0], the checkpoint's: 3.0")
# Defect (c).
FULLY_RESHARDABLE_BUG = Bug.raises("load", "KeyError: 'step'")

SCENARIOS = (
    Scenario(
        ID,
        "fresh_load",
        f"{_CORE}:fresh_load",
        2,
        {">=0.12.0,<=0.19.2": FRESH_LOAD_BUG},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        applicable=f"{_CORE}:dp_reshardable_keeps_step",
        alongside=("numpy2-product",),  # before 0.15 the model-space save calls numpy's product
        doc="dp_reshardable checkpoint (model space before 0.15) loaded into a freshly built distributed "
        "optimizer (torch Adam)",
    ),
    Scenario(
        ID,
        "stale_step",
        f"{_CORE}:stale_step",
        2,
        {">=0.16.0,<=0.19.2": STALE_STEP_BUG},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        requires=(f"{MODULE}:DistributedOptimizer.sharded_param_state_dp_reshardable",),
        applicable=f"{_CORE}:dp_reshardable_keeps_step",
        doc="dp_reshardable, one step taken before the load: every parameter's step must be the checkpoint's",
    ),
    Scenario(
        ID,
        "fully_reshardable",
        f"{_CORE}:fully_reshardable",
        2,
        {">=0.15.0,<=0.19.2": FULLY_RESHARDABLE_BUG},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        requires=(f"{MODULE}:DistributedOptimizer.sharded_param_state_fully_reshardable",),
        doc="fully_reshardable, one step taken before the load",
    ),
    Scenario(
        ID,
        "hybrid_stale_step",
        f"{_CORE}:hybrid_stale_step",
        2,
        {">=0.16.0,<=0.19.2": STALE_STEP_BUG},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        requires=(
            f"{MODULE}:DistributedOptimizer.sharded_param_state_dp_reshardable",
            f"{MODULE}:HybridDeviceOptimizer",
        ),
        applicable=f"{_CORE}:dp_reshardable_keeps_step",
        doc="CPU offload (HybridDeviceOptimizer, precision-aware), dp_reshardable, one step before the load",
    ),
)
