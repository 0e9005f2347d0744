"""mimo-optimizer's source diffs (``patches/mimo-optimizer/``): :mod:`.core`, the Megatron-Core files' edits.

Two kinds, by what the runtime does. The saved layout (defects (a)-(d) on 0.17/0.18): the runtime
post-processes what MimoOptimizer's own methods return, so the diff is the minimal edit of the
release's own lines, proven equal by tests/patches. Each module's common state and the reading of old
layouts: the runtime runs functions of its own, so the diff carries their text, taken from
``runtime/common_state.py`` and ``runtime/old_layouts.py`` (``sourcediff.replacement_section``).
"""


def source_edits(release: str) -> list:
    """The edits for ``release``: one target, Megatron-Core."""
    from .core import source_edits

    return source_edits(release)
