"""torch-adam-step's source diffs (patches/torch-adam-step/<release>.patch): one target, Megatron-Core.

    python tools/patchgen torch-adam-step SRC_ROOT RELEASE > patches/torch-adam-step/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
