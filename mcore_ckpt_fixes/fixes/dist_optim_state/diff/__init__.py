"""dist-optim-state's source diffs (patches/dist-optim-state/<release>.patch): one target, Megatron-Core.

    python tools/patchgen dist-optim-state SRC_ROOT RELEASE > patches/dist-optim-state/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
