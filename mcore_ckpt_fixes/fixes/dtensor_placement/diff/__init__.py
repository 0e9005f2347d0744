"""dtensor-placement's source diffs (``patches/dtensor-placement/``): :mod:`.core`, the Megatron-Core files' edits.

The runtime (``runtime/core.py``) wraps the release's two helpers and ``SequentialMLP.sharded_state_dict``:
the diff is the minimal edit of the release's own lines there (a DTensor branch in each helper, the
replica index kept in SequentialMLP's loop). The branch calls a helper the release does not have,
``_dtensor_shard_for_checkpoint``; see :mod:`.core` for where its text comes from.
"""


def source_edits(release: str) -> list:
    """The edits for ``release``: one target, Megatron-Core."""
    from .core import source_edits

    return source_edits(release)
