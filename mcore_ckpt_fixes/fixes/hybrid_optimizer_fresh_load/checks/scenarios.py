"""hybrid-optimizer-fresh-load's round trips as the suite and ``selftest`` find them (no torch, no
Megatron here): ``optimizer_cpu_offload`` with the distributed optimizer on 2 gloo ranks, the model's
weights loaded without the optimizer's state, one step against a run whose optimizer was built over
those weights (checks/core.py). Three core-API cases (one world in the test:
tests/fixes/test_hybrid_optimizer_fresh_load.py) and megatron.training's fp32 job (0.17 on).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID, TRAINING

_CORE = f"{__package__}.core"
_PREPARE = f"{_CORE}:prepare"
# Raised by the check itself (checks/core.py: judge) where the hybrid optimizer stepped other values
# than the loaded model's, or the step differs from the reference's.
STALE = Bug.raises("compare", "AssertionError: the hybrid optimizer stepped other weights than the loaded model's")
# Without the fp32 fix an fp32 model's optimizer does not build (a bug of its own); the training job
# also loads the checkpoint's common state, which before 0.19 needs hybrid-optimizer-common-state.
FP32_ALONGSIDE = ("hybrid-optimizer-fp32-shards", "hybrid-optimizer-fp32-params", "hybrid-optimizer-common-state")

SCENARIOS = (
    Scenario(
        ID,
        "bf16",
        f"{_CORE}:bf16",
        2,
        {">=0.12.0,<=0.19.2": STALE},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        doc="bf16 model, no precision-aware optimizer: reload_model_params after load_state_dict, one step",
    ),
    Scenario(
        ID,
        "precision_aware",
        f"{_CORE}:precision_aware",
        2,
        {">=0.12.0,<0.13.0": STALE},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        doc="bf16 model with the precision-aware optimizer (the release's own refresh from 0.13 on)",
    ),
    Scenario(
        ID,
        "fp32",
        f"{_CORE}:fp32",
        2,
        {">=0.12.0,<=0.19.2": STALE},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        alongside=FP32_ALONGSIDE,
        doc="fp32 model: reload_model_params after load_state_dict, one step",
    ),
    Scenario(
        ID,
        "training",
        f"{_CORE}:training",
        2,
        {">=0.17.0,<=0.19.2": STALE},
        prepare=_PREPARE,
        requires=(f"{TRAINING}:load_checkpoint",),
        alongside=FP32_ALONGSIDE,
        timeout=400.0,
        doc="megatron.training fp32 job: save_checkpoint, load_checkpoint with --no-load-optim and --finetune, one step",
    ),
)
