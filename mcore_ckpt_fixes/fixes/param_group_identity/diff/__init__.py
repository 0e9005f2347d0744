"""param-group-identity's source diffs (patches/param-group-identity/<release>.patch): one target, Megatron-Core.

    python tools/patchgen param-group-identity SRC_ROOT RELEASE > patches/param-group-identity/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
