"""persistent-worker-failure as Megatron-Core would carry it, in
``megatron/core/dist_checkpointing/strategies/async_utils.py``: ``PersistentAsyncCaller``'s poll asks
whether the worker is alive when its completion queue is empty, and a rank whose worker died
without answering adds ``_PERSISTENT_WORKER_DIED`` to ``sync_all_async_calls``' all-reduce, where
every rank raises; the wait for the preload's acknowledgement is let go by a watcher thread when
the worker dies; and ``close`` of a caller whose worker died aborts it instead of joining its queue.
As runtime/core.py's layers do. tests/patches runs the same round trips with the
monkeypatch off.
"""

from __future__ import annotations

from packaging.version import Version

from ....sourcediff import Replace, insert_before

ASYNC_UTILS = "megatron/core/dist_checkpointing/strategies/async_utils.py"

_HELPERS = '''# What a rank whose persistent checkpoint worker died without answering adds to the all-reduce of
# "still writing" flags (each 0 or 1): the sum reaches it only where some worker died.
_PERSISTENT_WORKER_DIED = 1 << 24


def _release_preload_wait_if_worker_dies(preload_q, caller, done):
    """Until ``done`` is set: if the worker dies, acknowledge the preload it never will, so that the
    trainer's ``preload_q.join()`` returns; the next poll reports the death on every rank."""
    while not done.wait(0.1):
        if caller.process is not None and not caller.process.is_alive():
            try:
                preload_q.task_done()
            except ValueError:
                pass  # acknowledged before the worker died
            return


'''

_SYNC_OLD = "        torch.distributed.all_reduce(ten)\n        return ten[0] == 0\n"
_SYNC_NEW = (
    "        torch.distributed.all_reduce(ten)\n"
    "        if ten[0] >= _PERSISTENT_WORKER_DIED:\n"
    "            raise RuntimeError(\n"
    "                f'the persistent checkpoint worker of {int(ten[0]) // _PERSISTENT_WORKER_DIED} rank(s) '\n"
    "                'exited before it finished the save: the checkpoint is incomplete; '\n"
    "                \"the worker's error is in that rank's log\"\n"
    "            )\n"
    "        return ten[0] == 0\n"
)

_EMPTY_OLD = (
    "                except Empty:\n"
    "                    # This method is called after any `AsyncRequest` is pushed to the main loop\n"
)


def _empty_new(completions: str) -> str:
    return (
        "                except Empty:\n"
        "                    if not self.process.is_alive():\n"
        "                        # The worker died: an answer it sent just before may still be on its\n"
        "                        # way; else none will come, and every rank must know.\n"
        "                        try:\n"
        f"                            self.cur_item = {completions}.get(timeout=1.0)\n"
        "                        except Empty:\n"
        "                            if no_dist:\n"
        "                                raise RuntimeError(\n"
        "                                    'the persistent checkpoint worker of this rank exited before '\n"
        "                                    'it finished the save: the checkpoint is incomplete'\n"
        "                                )\n"
        "                            is_alive = _PERSISTENT_WORKER_DIED\n"
        "                        break\n"
        "                    # This method is called after any `AsyncRequest` is pushed to the main loop\n"
    )


def _join_new(preloads: str) -> str:
    return (
        "            done = threading.Event()\n"
        "            watcher = threading.Thread(\n"
        f"                target=_release_preload_wait_if_worker_dies, args=({preloads}, self, done), daemon=True\n"
        "            )\n"
        "            watcher.start()\n"
        f"            {preloads}.join()\n"
        "            done.set()\n"
        "            watcher.join()\n"
    )


# PersistentAsyncCaller.close (its abort branch, from 0.15): a dead worker never takes 'DONE' off
# its queue, so the join of a close without abort would wait for ever.
_CLOSE_OLD = "        if self.process:\n            if abort:\n"
_CLOSE_NEW = (
    "        if self.process:\n"
    "            # A worker that died never takes 'DONE' off its queue: joining it would wait for ever.\n"
    "            if abort or not self.process.is_alive():\n"
)


def source_edits(release: str) -> list:
    # The worker's queues are the caller's own before 0.17, the class's from 0.17.
    old = Version(release) < Version("0.17.0")
    completions = "self.comp_q" if old else "self._persistent_comp_q"
    preloads = "self.preload_q" if old else "self._persistent_preload_q"
    return [
        Replace(ASYNC_UTILS, "from abc import ABC, abstractmethod\n", "import threading\nfrom abc import ABC, abstractmethod\n"),
        insert_before(ASYNC_UTILS, "class AsyncCaller(ABC):\n", _HELPERS),
        Replace(ASYNC_UTILS, _SYNC_OLD, _SYNC_NEW),
        Replace(ASYNC_UTILS, _EMPTY_OLD, _empty_new(completions)),
        Replace(ASYNC_UTILS, f"            {preloads}.join()\n", _join_new(preloads)),
        Replace(ASYNC_UTILS, _CLOSE_OLD, _CLOSE_NEW),
    ]
