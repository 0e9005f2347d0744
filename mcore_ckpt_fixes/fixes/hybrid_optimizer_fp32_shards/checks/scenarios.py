"""hybrid-optimizer-fp32-shards' round trip as the suite and ``selftest`` find it (no torch, no
Megatron here): an fp32 GPT, Megatron's DDP and ``get_megatron_optimizer`` with the distributed
optimizer, ``optimizer_cpu_offload`` and the precision-aware optimizer on 2 gloo ranks: built and
trained against the update computed apart (checks/core.py). Not saved here: its load also needs
hybrid-optimizer-fp32-params, and tests/patches runs the scenario with every other fix off;
tests/fixes/test_hybrid_optimizer_fp32_shards.py also saves and loads it with ``dist_checkpointing``
and builds and trains a bf16 model with fp32 norms, in the same world.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# torch's Optimizer constructor, when the distributed optimizer rebuilds the hybrid optimizer.
NON_LEAF = Bug.raises("build", "ValueError: can't optimize a non-leaf Tensor")

SCENARIOS = (
    Scenario(
        ID,
        "fp32",
        f"{_CORE}:fp32",
        2,
        {">=0.12.0,<=0.19.2": NON_LEAF},
        prepare=f"{_CORE}:prepare",
        doc=(
            "an fp32 GPT, get_megatron_optimizer with the distributed optimizer and optimizer_cpu_offload: "
            "built, two steps equal to the same AdamW computed apart"
        ),
    ),
)
