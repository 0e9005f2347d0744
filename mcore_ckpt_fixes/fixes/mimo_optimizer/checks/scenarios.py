"""mimo-optimizer's round trips as the suite and ``selftest`` find them (no torch, no Megatron here).

Non-colocated MimoOptimizer, world 2 (selftest runs 2 ranks by default):

* ``world2``: over DistributedOptimizers (``dp_reshardable``: the only sharding type that
  round-trips on CPU, see checks/core.py); defects (a)-(d). Registered for 0.17/0.18 only: 0.19
  writes this layout itself, so with the fix off it is exact there (the applicability check says
  so and selftest skips it on 0.19).
* ``torch_adam``: over Megatron's non-distributed optimizer and torch's AdamW (what Megatron builds
  without TE/Apex), whose shared step is plain common state; defect (e), on 0.17-0.19.2.

The world-4 TP=2 variants (same functions, 4 ranks) are run by tests/fixes/test_mimo_optimizer.py.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_MIMO = f"{__package__}.core"


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
# From 0.19 upstream writes the per-module layout itself: ``world2`` is exact there with the fix off
# (tests/fixes/test_mimo_matrix.py covers the old-layout loads), so it is registered below 0.19 only.
MIMO_SAVE_SIDE = ">=0.17.0,<0.19.0"
MIMO_WORLD2_BUG = Bug.raises("save", _mimo_collision([0]))
MIMO_WORLD4_BUG = Bug.raises("save", _mimo_collision([0, 1]))
# Defect (e): the module off global rank 0 loads its Adam state without the step (rank 1 raises it
# in torch's Adam.__setstate__; the round trip shares it with every rank).
MIMO_COMMON_STATE = ">=0.17.0,<=0.19.2"
MIMO_STEP_BUG = Bug.raises("load_state_dict", "KeyError: 'step'")
SCENARIOS = (
    Scenario(
        ID,
        "world2",
        f"{_MIMO}:round_trip",
        2,
        {MIMO_SAVE_SIDE: MIMO_WORLD2_BUG},
        prepare=f"{_MIMO}:prepare",
        requires=_MIMO_REQUIRES,
        applicable=f"{_MIMO}:save_side_applicable",
        doc="language on rank 0, vision on rank 1, DistributedOptimizer dp_reshardable",
    ),
    Scenario(
        ID,
        "torch_adam",
        f"{_MIMO}:torch_adam",
        2,
        {MIMO_COMMON_STATE: MIMO_STEP_BUG},
        prepare=f"{_MIMO}:prepare",
        requires=_MIMO_REQUIRES,
        doc="language on rank 0, vision on rank 1, non-distributed optimizer over torch AdamW (bf16)",
    ),
)
