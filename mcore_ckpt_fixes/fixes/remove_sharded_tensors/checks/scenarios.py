"""remove-sharded-tensors' round trip as the suite and ``selftest`` find it (nothing heavy imported
here): the optimizer's tensors dropped from a torch_dist checkpoint saved with a separation hint, on
one gloo rank (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# 0.12-0.16: the strategy's removal renames a metadata_path torch's writer no longer has (after
# writing .metadata.tmp); 0.17-0.18: the public call asks the save strategy, which has no removal.
NO_METADATA_PATH = Bug.raises("remove", "AttributeError: 'FileSystemWriter' object has no attribute 'metadata_path'")
NO_METHOD = Bug.raises(
    "remove", "AttributeError: type object 'TorchDistSaveShardedStrategy' has no attribute 'remove_sharded_tensors'"
)

SCENARIOS = (
    Scenario(
        ID,
        "optimizer_files",
        f"{_CORE}:round_trip",
        1,
        {">=0.12.0,<0.17.0": NO_METADATA_PATH, ">=0.17.0,<0.19.0": NO_METHOD},
        prepare=f"{_CORE}:prepare",
        devices=("cpu",),
        doc="dist_checkpointing.remove_sharded_tensors(dir, 'optimizer') on a checkpoint saved with "
        "separation_hint='optimizer': the optimizer's keys and files gone, nothing left behind, the model exact",
    ),
)
