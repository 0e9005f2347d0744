"""rerun-state-constant-structure's source diffs (patches/rerun-state-constant-structure/<release>.patch):
one target, Megatron-Core. The runtime wraps ``RerunStateMachine.state_dict`` (it hands the call to
the release's own method), so the diff is the minimal edit of the release's own lines (diff/core.py).

    python tools/patchgen rerun-state-constant-structure SRC_ROOT RELEASE > patches/rerun-state-constant-structure/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
