"""gdn-fsdp-split's source diffs (``patches/gdn-fsdp-split/``): :mod:`.core`, the Megatron-Core file's edit.

The runtime replaces ``handle_gdn_in_state_dict`` whole, so the diff carries the runtime's own text
(``runtime/split.py``, via ``sourcediff.replacement_section``): the diff is the executed code.
"""


def source_edits(release: str) -> list:
    """The edits for ``release``: one target, Megatron-Core."""
    from .core import source_edits

    return source_edits(release)
