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


def with_globals(fn, **names):
    """A copy of the function ``fn`` that sees ``names`` in place of its module's globals of those
    names: a probe runs the release's own code as if, e.g., the release had taken another import
    branch, while the live module (which other threads may be running) is left as it is."""
    import types

    scope = dict(fn.__globals__, **names)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy
