"""hsdp-ep-guard: Megatron-FSDP with HSDP and EP > 1 silently shards experts on the dense mesh.

Registered so that ``status`` lists it honestly; not implemented yet (issue #6): nothing is patched.
"""

from ..engine.fix import Fix

FIX = Fix(
    id="hsdp-ep-guard",
    summary="Megatron-FSDP with HSDP and EP > 1 silently shards experts on the dense mesh",
    affected=">=0.16.0,<0.17.0",
    implemented=False,
    tracking="issue #6",
)
