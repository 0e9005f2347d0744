"""expert-keys: fsdp_dtensor expert biases keep local indices, so EP ranks write the same key.

Registered so that ``status`` lists it honestly; not implemented yet (issue #6): nothing is patched.
"""

from ..engine.fix import Fix

FIX = Fix(
    id="expert-keys",
    summary="fsdp_dtensor expert biases keep local indices, so EP ranks write the same key",
    affected=">=0.16.0,<=0.19.2",
    implemented=False,
    tracking="issue #6",
)
