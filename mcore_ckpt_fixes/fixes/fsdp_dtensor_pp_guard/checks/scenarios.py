"""fsdp-dtensor-pp-guard's round trip as the suite and ``selftest`` find it (no torch, no Megatron here).

World 2: megatron.training's fsdp_dtensor save with PP=1 (DP=2), load with PP=2, then with PP=1
again (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Stage 1's first layer is global layer 1; the release gives it the checkpoint's layer 0.
OTHER_STAGES_LAYERS = Bug.raises(
    "layers",
    "AssertionError: stage 1's decoder.layers.0 (global layer 1) holds the checkpoint's layer 0 after a "
    "PP=2 load of a PP=1 checkpoint",
)

SCENARIOS = (
    Scenario(
        ID,
        "pp1_to_pp2",
        f"{_CORE}:round_trip",
        2,
        {">=0.17.0,<=0.19.2": OTHER_STAGES_LAYERS},
        prepare=f"{_CORE}:prepare",
        requires=("megatron.training.checkpointing:preprocess_fsdp_dtensor_state_dict",),
        doc="a 2-layer GPT saved in fsdp_dtensor with PP=1 by megatron.training, loaded with PP=2, then PP=1",
    ),
)
