"""hybrid-optimizer-fp32-shards' source diffs (patches/hybrid-optimizer-fp32-shards/<release>.patch):
one target, Megatron-Core. runtime/ post-processes what the release's method returns, so the diff
is the minimal edit of the release's own line (diff/core.py).

    python tools/patchgen hybrid-optimizer-fp32-shards SRC_ROOT RELEASE > patches/hybrid-optimizer-fp32-shards/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
