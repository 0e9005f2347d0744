"""rerun-state-strict-load's source diffs (patches/rerun-state-strict-load/<release>.patch): one
target, Megatron-Core; a minimal edit of the release's own lines (the runtime wraps the function).

    python tools/patchgen rerun-state-strict-load SRC_ROOT RELEASE > patches/rerun-state-strict-load/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
