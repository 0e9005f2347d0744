"""forked-save-writers as Megatron-Core would carry it, in
``megatron/core/dist_checkpointing/strategies/filesystem_async.py``: ``write_buckets_in_threads`` and
its helper (their text from runtime/core.py's replacement section, the code the monkeypatch runs)
above ``FileSystemWriterAsync``, and ``get_save_function_and_args`` hands it out instead of
``write_preloaded_data_multiproc`` (which stays, unused). tests/patches runs the same round trip
with the monkeypatch off.
"""

from __future__ import annotations

from packaging.version import Version

from ....sourcediff import Replace, insert_before, replacement_section

FILESYSTEM_ASYNC = "megatron/core/dist_checkpointing/strategies/filesystem_async.py"


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    # 0.12 binds the transforms only; 0.13 on also use_msc.
    if Version(release) < Version("0.13.0"):
        old = "partial(self.write_preloaded_data_multiproc, transform_list),"
        new = "partial(write_buckets_in_threads, transform_list, False),"
    else:
        old = "partial(self.write_preloaded_data_multiproc, transform_list, self.use_msc),"
        new = "partial(write_buckets_in_threads, transform_list, self.use_msc),"
    return [
        Replace(FILESYSTEM_ASYNC, "import queue\n", "import queue\nimport threading\n"),
        insert_before(FILESYSTEM_ASYNC, "class FileSystemWriterAsync(FileSystemWriter):", _helpers()),
        Replace(FILESYSTEM_ASYNC, old, new),
    ]
