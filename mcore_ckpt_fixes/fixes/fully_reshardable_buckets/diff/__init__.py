"""fully-reshardable-buckets's source diffs (patches/fully-reshardable-buckets/<release>.patch): one target, Megatron-Core.

    python tools/patchgen fully-reshardable-buckets SRC_ROOT RELEASE > patches/fully-reshardable-buckets/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
