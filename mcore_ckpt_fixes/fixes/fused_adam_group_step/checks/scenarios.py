"""fused-adam-group-step's round trip as the suite and ``selftest`` find it (nothing heavy imported
here): 2 gloo ranks, a FusedAdam param group empty on DP rank 0, saved as a release <= 0.13 saves
it and resumed (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# 0.12-0.13 resume their own checkpoint with that group restarted at step 1 (the check's comparison
# with the uninterrupted run finds it); 0.14+ stop at the first save after the resume (the rank
# holding the group raises, every rank reports its line: testing/world_errors.py).
RESTARTED = Bug.raises(
    "compare",
    "AssertionError: the resumed run differs from the uninterrupted run (a group's step, and so its Adam update)",
)
STEPS_ASSERT = Bug.raises("save", "AssertionError: steps: [8, 3]")

SCENARIOS = (
    Scenario(
        ID,
        "empty_on_writer",
        f"{_CORE}:round_trip",
        2,
        {">=0.12.0,<0.14.0": RESTARTED, ">=0.14.0,<=0.19.2": STEPS_ASSERT},
        prepare=f"{_CORE}:prepare",
        alongside=("numpy2-product",),  # the releases <= 0.13 save through numpy's product, gone in numpy 2
        doc="FusedAdam, DP=2, the no-weight-decay group empty on DP rank 0: saved dp_zero_gather_scatter by a "
        "release <= 0.13 after 5 steps, resumed, 3 steps, saved, loaded again",
    ),
)
