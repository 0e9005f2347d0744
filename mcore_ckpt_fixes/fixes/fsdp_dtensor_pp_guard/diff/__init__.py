"""fsdp-dtensor-pp-guard's source diffs (patches/fsdp-dtensor-pp-guard/), one module per target:
:mod:`.core` (megatron/training/checkpointing.py, in the wheel from 0.17.0) and :mod:`.bridge`
(Megatron-Bridge's own megatron/bridge/training/checkpointing.py, ``megatron-bridge-<version>``).

    python tools/patchgen fsdp-dtensor-pp-guard SRC_ROOT RELEASE > patches/fsdp-dtensor-pp-guard/RELEASE.patch

Both insert the refusal helper verbatim from the runtime module's replacement section and call it
where the release has just read the checkpoint's saved layout (the minimal edit of the release's own
lines: the runtime wraps, it replaces no function). Imports no torch or megatron.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError
from .core import source_edits as core_edits

# Frameworks that keep their own copy of the bug: ``<dist>-<version>`` names the framework's release.
_FRAMEWORKS = ("megatron-bridge",)


def source_edits(release: str) -> list:
    dist, _, version = release.rpartition("-")
    if dist:
        if dist not in _FRAMEWORKS:
            raise PatchgenError(f"fsdp-dtensor-pp-guard has no edits for {dist!r} (frameworks: {', '.join(_FRAMEWORKS)})")
        from .bridge import source_edits as bridge_edits

        return bridge_edits(version)
    return core_edits(release)
