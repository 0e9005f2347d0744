"""mimo-optimizer's round trips as the suite and ``selftest`` find them (no torch, no Megatron here).

Non-colocated MimoOptimizer over DistributedOptimizers (``dp_reshardable``: the only sharding type
that round-trips on CPU, see round_trips.py). Registered: world 2 (selftest runs 2 ranks by
default). The world-4 TP=2 variant (same function, 4 ranks, :data:`MIMO_WORLD4_BUG`) is run by
tests/fixes/test_mimo_optimizer.py.
"""

from __future__ import annotations

from ...testing.registry import Bug, Scenario
from . import ID

_MIMO = "mcore_ckpt_fixes.fixes.mimo_optimizer.round_trips"


def _mimo_collision(idxs):
    """Megatron's save-time validation error when two modules' DistributedOptimizers both name
    their objects ``optimizer.distributed.dp_group_idx_<mp rank>...`` (defect (d))."""
    errors = []
    for i in idxs:
        for what in ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded"):
            errors.append(f"Duplicate ShardedObject keys: ['optimizer.distributed.dp_group_idx_{i}.{what}/shard_0_1']")
            errors.append("Invalid access pattern: -1 ShardedObject are missing.")
    return "CheckpointingException: Invalid sharding pattern validation. Errors: " + "\n".join(errors)


_MIMO_REQUIRES = ("megatron.core.models.mimo.optimizer:MimoOptimizer",)
# On 0.19 the fix is the load side only (reading what unfixed 0.17/0.18 wrote): this round trip is
# exact there with the fix off (tests/fixes/test_mimo_matrix.py covers the old-layout loads).
MIMO_SAVE_SIDE = ">=0.17.0,<0.19.0"
MIMO_WORLD2_BUG = Bug.raises("save", _mimo_collision([0]))
MIMO_WORLD4_BUG = Bug.raises("save", _mimo_collision([0, 1]))
SCENARIOS = (
    Scenario(
        ID, "world2", f"{_MIMO}:round_trip", 2,
        {MIMO_SAVE_SIDE: MIMO_WORLD2_BUG},
        prepare=f"{_MIMO}:prepare", devices=("cpu",), requires=_MIMO_REQUIRES,
        doc="language on rank 0, vision on rank 1, DistributedOptimizer dp_reshardable",
    ),
)
