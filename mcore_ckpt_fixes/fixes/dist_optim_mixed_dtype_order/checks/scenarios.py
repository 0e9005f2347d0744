"""dist-optim-mixed-dtype-order's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here): six equal-sized parameters, two bf16 then four fp32, in one parameter group of the
distributed optimizer (Apex's FusedAdam, a CPU stand-in), saved as ``fully_reshardable`` (model space
before 0.15) with DP=2 and loaded with DP=1
on 2 gloo ranks (checks/core.py). tests/fixes/test_dist_optim_mixed_dtype_order.py also runs a bf16
GPT with fp32 norms saved and loaded as ``dp_reshardable``, in the same world.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# checks/core.py's SWAPPED (not imported: this module imports no torch).
SWAPPED = Bug.raises("compare", "AssertionError: parameters loaded other parameters' main values and optimizer state")

SCENARIOS = (
    Scenario(
        ID,
        "equal_sizes",
        f"{_CORE}:equal_sizes",
        2,
        {">=0.13.0,<=0.19.2": SWAPPED},
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        # fully_reshardable (model space before 0.15, which has no fully_reshardable): the layout that
        # hands swapped state to a reader of another data-parallel size.
        alongside=("numpy2-product",),  # before 0.16 the model-space save calls numpy's product
        applicable=f"{_CORE}:next_step_comparable",
        doc=(
            "bf16 and fp32 parameters of one shape in one group, the distributed optimizer: saved "
            "fully_reshardable (model space before 0.15) with DP=2, loaded with DP=1, every parameter's main value and Adam "
            "moments its own, and the next step the uninterrupted run's"
        ),
    ),
)
