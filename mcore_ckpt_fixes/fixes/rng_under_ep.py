"""rng-under-ep: torch_dist RNG state is keyed (pp, tp): EP ranks > 0 resume on another rank's streams.

Registered so that ``status`` lists it honestly; not implemented yet (issue #6): nothing is patched.
"""

from ..engine.fix import Fix

FIX = Fix(
    id="rng-under-ep",
    summary="torch_dist RNG state is keyed (pp, tp): EP ranks > 0 resume on another rank's streams",
    affected=">=0.17.0,<=0.19.2",
    implemented=False,
    tracking="issue #6",
)
