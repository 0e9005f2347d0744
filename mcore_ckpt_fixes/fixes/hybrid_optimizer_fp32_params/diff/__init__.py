"""hybrid-optimizer-fp32-params' source diffs (patches/hybrid-optimizer-fp32-params/<release>.patch):
one target, Megatron-Core.

    python tools/patchgen hybrid-optimizer-fp32-params SRC_ROOT RELEASE > patches/hybrid-optimizer-fp32-params/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
