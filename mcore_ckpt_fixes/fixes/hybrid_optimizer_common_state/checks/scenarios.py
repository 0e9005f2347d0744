"""hybrid-optimizer-common-state's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here): a hybrid optimizer's common state as 0.15-0.18 save it, read by the release
(checks/core.py); tests/fixes/test_hybrid_optimizer_common_state.py also runs the whole
``fully_reshardable`` round trip in the same world.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The first class the load meets: the hybrid optimizer's CPU optimizer (checks/core.py's refusal_line).
REFUSED = Bug.raises("load", "UnpicklingError: weights_only refuses torch.optim.adamw.AdamW")

SCENARIOS = (
    Scenario(
        ID,
        "legacy_common_state",
        f"{_CORE}:round_trip",
        2,
        {">=0.14.0,<=0.19.2": REFUSED},
        prepare=f"{_CORE}:prepare",
        alongside=("numpy2-product",),  # 0.14's save calls numpy's product, gone in numpy 2
        doc="the common state of a hybrid optimizer's fully_reshardable save (0.14-0.18: fully_sharded_model_space on 0.14), read back",
    ),
)
