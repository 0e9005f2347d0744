"""numpy2-product as Megatron-Core would carry it: each ``np.product(`` of
``megatron/core/dist_checkpointing`` becomes ``np.prod(`` (NumPy 1 has both, NumPy 2 only
``prod``), one call in each of three files. tests/patches runs the same round trip with the
monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

_FILES = ("exchange_utils.py", "validation.py", "mapping.py")


def source_edits(release: str) -> list:
    return [Replace(f"megatron/core/dist_checkpointing/{f}", "np.product(", "np.prod(") for f in _FILES]
