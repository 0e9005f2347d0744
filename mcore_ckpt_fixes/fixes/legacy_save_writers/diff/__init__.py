"""legacy-save-writers' source diffs (patches/legacy-save-writers/<release>.patch): one target, Megatron-Core.

    python tools/patchgen legacy-save-writers SRC_ROOT RELEASE > patches/legacy-save-writers/RELEASE.patch

The runtime wraps ``save_checkpoint`` (it cannot reach the condition inside its body otherwise), so
the diff is the minimal edit of the release's own condition, plus the helper that elects the writer,
its text taken from runtime/core.py's replacement section. Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
