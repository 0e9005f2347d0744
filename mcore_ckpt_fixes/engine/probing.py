"""Stand-ins the fixes' behavioural probes share (nothing heavy imported)."""

from __future__ import annotations


class Group:
    """Stands in for a process group in a probe: only ``rank()`` and ``size()`` are read."""

    __slots__ = ("_rank", "_size")

    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def __repr__(self):
        return f"Group(rank={self._rank}, size={self._size})"
