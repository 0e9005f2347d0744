"""scheduler-override-group-lr's source diffs (patches/scheduler-override-group-lr/<release>.patch):
one target, Megatron-Core; a minimal edit of the release's own ``OptimizerParamScheduler`` (the
runtime wraps its two methods).

    python tools/patchgen scheduler-override-group-lr SRC_ROOT RELEASE > patches/scheduler-override-group-lr/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
