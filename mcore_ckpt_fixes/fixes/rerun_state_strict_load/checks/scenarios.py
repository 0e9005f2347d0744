"""rerun-state-strict-load's round trip as the suite and ``selftest`` find it (no torch, no Megatron
here). World 2: a ``torch_dist`` checkpoint holding the rerun state machine's idle entry, loaded as
``load_checkpoint`` loads it (the entry left out of the request) under every strictness value;
through megatron.training's save_checkpoint / load_checkpoint with ``raise_all`` where the release
ships it (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# What dist_checkpointing's validation raises under raise_all (its two lines joined: checks/core.py).
REJECTED = Bug.raises(
    "load",
    "CheckpointingException: Some keys found in the checkpoint are missing in the provided sharded state dict. "
    "Missing keys (for all ranks): {'rerun_state_machine_state'}.",
)

SCENARIOS = (
    Scenario(
        ID,
        "idle_rerun_state_strict_load",
        f"{_CORE}:round_trip",
        2,
        REJECTED,
        prepare=f"{_CORE}:prepare",
        doc="a torch_dist checkpoint with the rerun state machine's idle entry, loaded without it (as "
        "load_checkpoint asks) under every --dist-ckpt-strictness value, and through megatron.training "
        "with raise_all",
    ),
)
