"""rerun-transient-checkpoint's source diffs (patches/rerun-transient-checkpoint/<release>.patch): one
target, Megatron-Core. The runtime wraps ``RerunStateMachine.should_checkpoint_and_exit`` and
``load_state_dict`` (each hands the call to the release's own method), so the diff is the minimal
edit of the release's own lines (diff/core.py).

    python tools/patchgen rerun-transient-checkpoint SRC_ROOT RELEASE > patches/rerun-transient-checkpoint/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
