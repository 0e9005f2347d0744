"""dp-reshardable-padding's source diffs (patches/dp-reshardable-padding/<release>.patch): one
target, Megatron-Core.

    python tools/patchgen dp-reshardable-padding SRC_ROOT RELEASE > patches/dp-reshardable-padding/RELEASE.patch

The runtime post-processes the state ``sharded_param_state_dp_reshardable`` describes, so the diff is
the release's own method with one call through the helper, whose text is taken from the runtime
module. Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
