"""hsdp-ep-guard's source diff (``patches/hsdp-ep-guard/``): :mod:`.core`, the Megatron-Core file's edit.

The minimal edit of the release's own lines: the runtime (``runtime/core.py``) puts the guard in front
of the release's ``_init_dist_index`` and calls the original, so the diff inserts the same guard at the
top of that method and leaves the rest as it is. The message both raise is the runtime's ``refusal``,
imported, not restated.
"""


def source_edits(release: str) -> list:
    """The edits for ``release``: one target, Megatron-Core."""
    from .core import source_edits

    return source_edits(release)
