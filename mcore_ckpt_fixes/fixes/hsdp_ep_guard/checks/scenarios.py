"""hsdp-ep-guard's round trip, as selftest and the tests find it (light: no torch).

hsdp-ep-guard is a guard: with it, HSDP x EP=2 is refused at set-up with the guard's one line
(the scenario accepts exactly that line as the outcome) and the other configurations round-trip;
without it, 0.16 places the experts on the dense mesh, which the scenario reports as below.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID, MODULE

_HG = f"{__package__}.core"
# What the scenario's placement check says when a configuration's expert parameters got the dense mesh.
DENSE_MESH = "expert parameters are sharded on the dense data-parallel mesh, not over their expert-data-parallel ranks"
DENSE_MESH_BUG = Bug.raises("placement", f"AssertionError: hsdp_ep2: {DENSE_MESH}")

SCENARIOS = (
    Scenario(
        ID,
        "configurations",
        f"{_HG}:configurations",
        4,
        DENSE_MESH_BUG,
        prepare=f"{_HG}:prepare",
        devices=("cpu",),
        timeout=240,
        requires=(f"{MODULE}:FullyShardedDataParallel",),
        applicable=f"{_HG}:expert_meshes_exist",
        doc="Megatron-FSDP meshes for EP=2, HSDP, HSDP x EP=2 on 4 ranks; DCP round trip on each accepted one",
    ),
)
