"""expert-keys' source diffs (``patches/expert-keys/``), one module per target.

:mod:`.core`: Megatron-Core's files; the key functions' text is the runtime's own
(``runtime/keys.py``, via ``sourcediff.replacement_section``): the runtime replaces them whole, so the
diff carries the executed code. :mod:`.bridge`: Megatron-Bridge's checkpointing, the minimal edit (an
import of the patched preprocessing).
"""

from ....sourcediff import PatchgenError

# ``<dist>-<version>`` releases: a framework's own files, edited by the module of that name.
_FRAMEWORKS = {"megatron-bridge": "bridge"}


def source_edits(release: str) -> list:
    """The edits for ``release``: a Megatron-Core release, or ``megatron-bridge-<version>``."""
    import importlib

    dist, _, version = release.rpartition("-")
    if dist:
        if dist not in _FRAMEWORKS:
            raise PatchgenError(f"expert-keys has no edits for {dist!r} (frameworks: {', '.join(_FRAMEWORKS)})")
        return importlib.import_module(f"{__name__}.{_FRAMEWORKS[dist]}").source_edits(version)
    return importlib.import_module(f"{__name__}.core").source_edits(release)
