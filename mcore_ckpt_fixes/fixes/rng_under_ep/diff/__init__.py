"""rng-under-ep's source diffs (``patches/rng-under-ep/``), one module per target: :mod:`.core`
(Megatron-LM's ``megatron/training/checkpointing.py``), :mod:`.bridge`, :mod:`.verl`, :mod:`.ms_swift`
(each framework's own copy of the code, ``<dist>-<version>``).

The runtime wraps the release's functions (``get_rng_state`` and the load entry points) and
post-processes what they return: each diff is the minimal edit of the release's own lines, proven by
tests/patches and the framework tests with the monkeypatch off. Where a diff inserts a helper of its
own (``_align_rng_state_request`` in :mod:`.core`, shared verbatim by :mod:`.verl` and
:mod:`.ms_swift`; Bridge's and verl's load-side helpers), that helper is written as the release's own
code, next to the runtime's counterpart in ``runtime/old_layouts.py`` and ``runtime/fsdp_dtensor.py``,
which computes the same request from the checkpoint's metadata.
"""

from ....sourcediff import PatchgenError

# Frameworks that keep their own copy of the bug: ``<dist>-<version>`` names the framework's release,
# and the module of that name here has its edits.
_FRAMEWORKS = {"verl": "verl", "ms-swift": "ms_swift", "megatron-bridge": "bridge"}


def source_edits(release: str) -> list:
    """The edits for ``release`` (0.17, 0.18 and 0.19 lines, or ``<framework dist>-<version>``), in
    the order they are applied."""
    import importlib

    dist, _, version = release.rpartition("-")
    if dist:
        if dist not in _FRAMEWORKS:
            raise PatchgenError(f"rng-under-ep has no edits for {dist!r} (frameworks: {', '.join(_FRAMEWORKS)})")
        return importlib.import_module(f"{__name__}.{_FRAMEWORKS[dist]}").source_edits(version)
    return importlib.import_module(f"{__name__}.core").source_edits(release)
