"""numpy2-product's source diffs (patches/numpy2-product/<release>.patch): one target, Megatron-Core.

    python tools/patchgen numpy2-product SRC_ROOT RELEASE > patches/numpy2-product/RELEASE.patch

The runtime rebinds ``np`` only because a module's name is what a monkeypatch can reach; in the
source the edit is the call itself. Imports no torch or megatron.
"""

from __future__ import annotations

from .core import source_edits as core_edits


def source_edits(release: str) -> list:
    return core_edits(release)
