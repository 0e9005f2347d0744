"""chained-optim-main-params-split's source diffs (patches/chained-optim-main-params-split/<release>.patch):
one target, Megatron-Core.

    python tools/patchgen chained-optim-main-params-split SRC_ROOT RELEASE > patches/chained-optim-main-params-split/RELEASE.patch

The runtime wraps ``ChainedOptimizer._split_state_dict`` (the release's split stays for calls it
does not recognise), so the diff is the release's own method with one early return through the
helper, whose text is taken from the runtime module. Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
