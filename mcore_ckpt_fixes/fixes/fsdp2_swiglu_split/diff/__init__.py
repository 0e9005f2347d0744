"""fsdp2-swiglu-split's source diffs (patches/fsdp2-swiglu-split/<release>.patch): one target,
Megatron-Core.

    python tools/patchgen fsdp2-swiglu-split SRC_ROOT RELEASE > patches/fsdp2-swiglu-split/RELEASE.patch

The runtime wraps ``MLP.sharded_state_dict`` and post-processes the two SwiGLU factories, so the
diff is the minimal edit of the release's own call, plus the helpers it calls, whose text is taken
from the runtime module. Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
