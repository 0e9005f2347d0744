"""dist-optim-mixed-dtype-order's source diffs (patches/dist-optim-mixed-dtype-order/<release>.patch):
one target, Megatron-Core. runtime/ post-processes what the release's method returns, so the diff is
the minimal edit of the release's own method (diff/core.py).

    python tools/patchgen dist-optim-mixed-dtype-order SRC_ROOT RELEASE > patches/dist-optim-mixed-dtype-order/RELEASE.patch

Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
