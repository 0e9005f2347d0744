"""float16-optim-fp32-params' round trip as the suite and ``selftest`` find it (no torch, no Megatron
here): the non-distributed mixed-precision optimizer over a bf16, an fp32 and a bf16 parameter in one
group, saved and loaded with ``dist_checkpointing`` on 2 gloo ranks (checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The release's map gives state id 1 (the fp32 parameter's, 8x8) the last bf16 parameter (4x8); were
# their shapes equal, it would stop one id later, on the id the map lacks (ValueError: Param id 2 ...).
MISPAIRED = Bug.raises("save", "AssertionError: Optimizer shape ((8, 8) does not match model shape ((4, 8))")

SCENARIOS = (
    Scenario(
        ID,
        "fp32_param_between_bf16",
        f"{_CORE}:round_trip",
        2,
        {">=0.12.0,<=0.19.2": MISPAIRED},
        prepare=f"{_CORE}:prepare",
        doc="Float16OptimizerWithFloat16Params over bf16, fp32 and bf16 parameters in one group (DDP, DP=2), "
        "saved and loaded with dist_checkpointing: every parameter, fp32 main value and Adam moment its own, "
        "and the next step the uninterrupted run's",
    ),
)
