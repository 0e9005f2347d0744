"""fsdp-dtensor-pp-guard's source diffs (patches/fsdp-dtensor-pp-guard/<release>.patch): one target,
megatron/training/checkpointing.py (in the wheel from 0.17.0).

    python tools/patchgen fsdp-dtensor-pp-guard SRC_ROOT RELEASE > patches/fsdp-dtensor-pp-guard/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
