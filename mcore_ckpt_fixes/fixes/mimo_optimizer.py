"""mimo-optimizer: MimoOptimizer checkpoints with non-colocated modules lose state, metadata and key uniqueness.

Registered so that ``status`` lists it honestly; not implemented yet (issue #4): nothing is patched.
"""

from ..engine.fix import Fix

FIX = Fix(
    id="mimo-optimizer",
    summary="MimoOptimizer checkpoints with non-colocated modules lose state, metadata and key uniqueness",
    affected=">=0.17.0,<0.19.0",
    implemented=False,
    tracking="issue #4",
)
