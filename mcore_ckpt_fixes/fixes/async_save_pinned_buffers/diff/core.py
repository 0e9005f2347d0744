"""async-save-pinned-buffers as Megatron-Core would carry it, in
``megatron/core/dist_checkpointing/strategies/async_utils.py``: ``TemporalAsyncCaller`` keeps the
preload's result (the pinned copies its forked writer reads) on the caller from
``schedule_async_call`` until ``close`` has joined or killed the writer, as runtime/core.py's layers
do. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

ASYNC_UTILS = "megatron/core/dist_checkpointing/strategies/async_utils.py"

_PRELOAD = "            async_fn_args[1] = async_req.preload_fn()\n"
_JOINED = (
    "            self.process = None\n"
    "            logger.debug(\n"
    '                "TemporalAsyncCaller: Async process join finished "\n'
)


def source_edits(release: str) -> list:
    return [
        Replace(
            ASYNC_UTILS,
            _PRELOAD,
            _PRELOAD
            + "            # Kept until close() has joined the writer: pinned copies freed here would be\n"
            + "            # reused by the trainer's next device-to-host copies while the forked writer\n"
            + "            # still reads them (pinned memory is not copied on write across a fork).\n"
            + "            self.staged_preload = async_fn_args[1]\n",
        ),
        Replace(ASYNC_UTILS, _JOINED, _JOINED.replace("None\n", "None\n            self.staged_preload = None\n", 1)),
    ]
