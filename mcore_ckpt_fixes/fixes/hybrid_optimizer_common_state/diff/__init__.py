"""hybrid-optimizer-common-state's source diffs (patches/hybrid-optimizer-common-state/<release>.patch): one target, Megatron-Core.

    python tools/patchgen hybrid-optimizer-common-state SRC_ROOT RELEASE > patches/hybrid-optimizer-common-state/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
