"""tp-group's source diffs (``patches/tp-group/``): :mod:`.core`, the Megatron-Core files' edits.

The minimal edit of the release's own lines: the runtime (``runtime/core.py``) wraps ``__init__``
and ``sharded_state_dict`` from outside the classes, which is not how the code would be written
in place, so the diff makes upstream's own change (the groups kept on the modules, as 0.19 does)
and tests/patches proves it behaves as the runtime does (every probe says fixed, every round trip
exact with the monkeypatch off).
"""


def source_edits(release: str) -> list:
    """The edits for ``release``: one target, Megatron-Core."""
    from .core import source_edits

    return source_edits(release)
