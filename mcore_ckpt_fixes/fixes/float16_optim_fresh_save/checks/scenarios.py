"""float16-optim-fresh-save's round trips as the suite and ``selftest`` find them (nothing heavy
imported here): the non-distributed fp16 optimizer, whose first step overflows and is skipped, saved
and loaded with ``dist_checkpointing`` on 2 gloo ranks, on Apex FusedAdam's path and on torch's Adam
(checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The load request (is_loading=True) describes Adam's moments; the checkpoint of an optimizer that
# had not stepped holds none.
# had not stepped holds none. The keys the checkpoint has are listed, 0.19's embedded common state among them.
_HAS = "'bias', {}'optimizer.state.fp32_param.bias', 'optimizer.state.fp32_param.weight', 'weight'"
_MISSING = 'KeyError: "optimizer.state.exp_avg.weight from model not in state dict: [{}]"'
MISSING_MOMENTS = {
    ">=0.12.0,<0.19.0": Bug.raises("load", _MISSING.format(_HAS.format(""))),
    ">=0.19.0,<=0.19.2": Bug.raises("load", _MISSING.format(_HAS.format("'common_state/shard_0_1', "))),
}

SCENARIOS = tuple(
    Scenario(
        ID,
        case,
        f"{_CORE}:{case}",
        2,
        MISSING_MOMENTS,
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        doc=f"fp16 Float16OptimizerWithFloat16Params ({what}), first step skipped by the loss scaler, saved and "
        "loaded with dist_checkpointing (DP=2): every value its own, no optimizer state as the source, and the "
        "next step the uninterrupted run's",
    )
    for case, what in (("fused_adam", "Apex FusedAdam's path"), ("torch_adam", "torch's Adam"))
)
