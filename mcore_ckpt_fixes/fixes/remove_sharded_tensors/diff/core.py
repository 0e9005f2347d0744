"""remove-sharded-tensors as Megatron-Core would carry it: in
``megatron/core/dist_checkpointing/strategies/torch.py``, ``TorchDistLoadShardedStrategy.remove_sharded_tensors``
renames the metadata file by the name it computes (``metadata_filename``) instead of the writer's
``metadata_path``, and removes each file under ``Path(checkpoint_dir)``; on 0.17-0.18,
``serialization.remove_sharded_tensors`` asks a load strategy (an instance) for the removal.
tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

STRATEGIES = "megatron/core/dist_checkpointing/strategies/torch.py"
SERIALIZATION = "megatron/core/dist_checkpointing/serialization.py"


def source_edits(release: str) -> list:
    edits = [
        Replace(STRATEGIES, "fs_writer.metadata_path", "metadata_filename", every=True),
        Replace(STRATEGIES, "fs_writer.fs.rm_file(checkpoint_dir / f)", "fs_writer.fs.rm_file(Path(checkpoint_dir) / f)"),
    ]
    if not release.startswith(("0.12", "0.13", "0.14", "0.15", "0.16")):
        edits.append(
            Replace(
                SERIALIZATION,
                "    TorchDistSaveShardedStrategy.remove_sharded_tensors(checkpoint_dir, key_prefix)\n",
                "    TorchDistLoadShardedStrategy().remove_sharded_tensors(checkpoint_dir, key_prefix)\n",
            )
        )
    return edits
