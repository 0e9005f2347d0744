"""gdn-fsdp-split: fsdp_dtensor save of Gated-DeltaNet fused projections applies the TP split twice.

Registered so that ``status`` lists it honestly; not implemented yet (issue #5): nothing is patched.
"""

from ..engine.fix import Fix

FIX = Fix(
    id="gdn-fsdp-split",
    summary="fsdp_dtensor save of Gated-DeltaNet fused projections applies the TP split twice",
    affected=">=0.18.0,<0.19.0",
    implemented=False,
    tracking="issue #5",
)
