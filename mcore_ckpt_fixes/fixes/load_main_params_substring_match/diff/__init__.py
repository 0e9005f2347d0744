"""load-main-params-substring-match's source diffs (patches/load-main-params-substring-match/<release>.patch):
one target, Megatron-Core.

    python tools/patchgen load-main-params-substring-match SRC_ROOT RELEASE > patches/load-main-params-substring-match/RELEASE.patch

The runtime replaces ``DistributedOptimizer._build_model_param_to_state_dict_param_map`` whole only
because the line it changes sits inside it; the rest is the release's. So the diff is the minimal
edit of that one line, plus the function it calls, whose text is taken from the runtime module.
Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
