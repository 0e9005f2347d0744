"""dtensor-placement: dist_checkpointing offsets of DTensor parameters come from the dense DP group, not the DTensor's mesh.

Registered so that ``status`` lists it honestly; not implemented yet (issue #10): nothing is patched.
"""

from ..engine.fix import Fix

FIX = Fix(
    id="dtensor-placement",
    summary="dist_checkpointing offsets of DTensor parameters come from the dense DP group, not the DTensor's mesh",
    affected=">=0.12.0,<=0.19.2",
    implemented=False,
    tracking="issue #10",
)
