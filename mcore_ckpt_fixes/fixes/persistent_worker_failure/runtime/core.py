"""persistent-worker-failure in a job: the layers on ``PersistentAsyncCaller.schedule_async_call``,
``is_current_async_call_done`` and ``close``, and ``AsyncCaller.sync_all_async_calls``, and the probe.
Why: doc.md.

A rank learns that its save finished from the persistent worker's completion queue. A worker that
died answers nothing, so the release's poll waits (or reports "still writing") for ever, and the
other ranks wait in its all-reduce. Here the poll also asks whether the worker is alive; a rank
whose worker died without answering adds :data:`DIED` to the all-reduce every rank makes anyway, and
every rank that sees it in the sum raises :class:`PersistentWorkerDied`.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import BASE, CLASS, FUNCTION, ID, MODULE, SYNC

# What a rank whose worker died adds to the all-reduce of "still writing" flags (each 0 or 1): the
# sum reaches it only where some worker died, for any world of fewer ranks than this.
DIED = 1 << 24
POLL_S = 0.1  # the release's own sleep between polls of the completion queue
LAST_WORDS_S = 1.0  # how long a completion the worker sent just before it exited may take to arrive


class PersistentWorkerDied(RuntimeError):
    """A rank's persistent checkpoint worker died before it finished a save."""


def completion_queue(caller):
    """The worker's completion queue: the class's from 0.17, the caller's own before."""
    found = getattr(caller, "_persistent_comp_q", None)
    return found if found is not None else getattr(caller, "comp_q", None)


def _wait(caller, blocking: bool) -> bool:
    """Take the worker's answer into ``cur_item`` as the release's poll does; True where the worker
    died without one (``blocking``: waiting for it, with the release's sleep between polls)."""
    if caller.process is None or caller.cur_item is not None:
        return False
    answers = completion_queue(caller)
    while True:
        try:
            caller.cur_item = answers.get_nowait()
            return False
        except queue.Empty:
            pass
        if not caller.process.is_alive():
            try:
                caller.cur_item = answers.get(timeout=LAST_WORDS_S)
                return False
            except queue.Empty:
                return True
        if not blocking:
            return False
        time.sleep(POLL_S)


def preload_queue(caller):
    """The queue of the worker's preload acknowledgements: the class's from 0.17, the caller's own before."""
    found = getattr(caller, "_persistent_preload_q", None)
    return found if found is not None else getattr(caller, "preload_q", None)


def _watch_preload(caller, done: threading.Event) -> None:
    """Until ``done``: where the worker dies, acknowledge the preload it never will, so that the
    release's ``join`` returns (the poll then finds the death and says so on every rank)."""
    while not done.wait(POLL_S):
        process = caller.process
        if process is not None and not process.is_alive():
            try:
                preload_queue(caller).task_done()
            except ValueError:
                pass  # the worker acknowledged it before it died: the join returns by itself
            return


@layer(ID, MODULE, "schedule_async_call", owner=CLASS)
def schedule_async_call(release, self, async_req):
    """The release hands the request to the worker and, where the request preloads, waits for the
    worker to acknowledge the preload (``join``): a worker that dies first holds this rank there for
    ever. Here a watcher thread lets the wait go when the worker dies; the next poll reports it."""
    if async_req.async_fn is None or async_req.preload_fn is None:
        return release(self, async_req)
    done = threading.Event()
    watcher = threading.Thread(target=_watch_preload, args=(self, done), daemon=True)
    watcher.start()
    try:
        return release(self, async_req)
    finally:
        done.set()
        watcher.join()


def _exit_code(caller):
    return getattr(caller.process, "exitcode", None)


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def is_current_async_call_done(release, self, blocking=False, no_dist=False):
    """The release's poll, but a worker that died without answering is found, not waited for: with
    ``no_dist`` this rank raises; otherwise it says so in the all-reduce (:func:`sync_all_async_calls`)."""
    if not _wait(self, blocking):
        return release(self, blocking, no_dist)
    if no_dist:
        raise PersistentWorkerDied(
            f"the persistent checkpoint worker of this rank exited (exit code {_exit_code(self)}) before it "
            "finished the save: the checkpoint is incomplete; the worker's error is in this rank's log"
        )
    return self.sync_all_async_calls(DIED)


@layer(ID, MODULE, SYNC, owner=BASE)
def sync_all_async_calls(release, self, is_alive):
    """The release's all-reduce of "still writing" flags (the same single int, summed), which also
    carries :data:`DIED`: where it is in the sum, every rank raises. (The release's own body cannot
    be called: it returns whether the sum is 0, not the sum.)"""
    import torch

    total = torch.tensor([int(is_alive)], dtype=torch.int, device=torch.cuda.current_device())
    torch.distributed.all_reduce(total)
    total = int(total[0])
    if total >= DIED:
        mine = "this rank's among them" if int(is_alive) >= DIED else "this rank's worker finished or is alive"
        raise PersistentWorkerDied(
            f"the persistent checkpoint worker of {total // DIED} rank(s) exited before it finished the save "
            f"({mine}): the checkpoint is incomplete; the worker's error is in that rank's log"
        )
    return total == 0


@layer(ID, MODULE, "close", owner=CLASS)
def close(release, self, *args, **kwargs):
    """The release's close; of a caller whose worker died, without the wait for it: the release puts
    'DONE' on the worker's queue and joins the queue, which a dead worker never empties, so the
    close (and the caller's ``__del__`` at exit) would hold the rank for ever. Aborted where the
    release can abort (0.15+: it kills the dead process and lets it go), let go where it cannot."""
    process = getattr(self, "process", None)
    if process is None or process.is_alive():
        return release(self, *args, **kwargs)
    if "abort" in _parameters(release):
        return release(self, abort=True)
    self.process = None  # what the release's close leaves, once its join has returned
    return None


_PARAMETERS: dict = {}


def _parameters(fn) -> tuple:
    found = _PARAMETERS.get(fn)
    if found is None:
        found = _PARAMETERS[fn] = tuple(inspect.signature(fn).parameters)
    return found


# -- probe: the release's poll of a worker that died without answering ----------------------------


class _DeadWorker:
    exitcode = 1

    def is_alive(self):
        return False


class _NoAnswers:
    def get_nowait(self):
        raise queue.Empty

    def get(self, block=True, timeout=None):
        raise queue.Empty


def release_polls_a_dead_worker_as_writing(cls) -> bool:
    """The release's non-blocking, rank-local poll of a caller whose worker died without answering
    (built without ``__init__``, which starts queues): "still writing" (False), where a blocking poll
    waits for ever, or an error (the worker's death seen)."""
    # A subclass without ``__del__``: the release's closes the caller (and logs its rank) when collected.
    caller = object.__new__(type("ProbeCaller", (cls,), {"__del__": lambda self: None}))
    caller.process, caller.cur_item, caller.cur_idx, caller.start_time = _DeadWorker(), None, 0, None
    caller.comp_q = caller._persistent_comp_q = _NoAnswers()
    try:
        return original(cls, FUNCTION)(caller, blocking=False, no_dist=True) is False
    except (AttributeError, TypeError):
        raise  # code that reads more than these stand-ins: not judged (the engine leaves it alone)
    except Exception:
        return False  # the death reported


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__ or SYNC not in getattr(module.__dict__.get(BASE), "__dict__", {}):
        return None, f"{MODULE} has no {CLASS}.{FUNCTION} or {BASE}.{SYNC}"
    if not release_polls_a_dead_worker_as_writing(cls):
        return False, f"{CLASS}.{FUNCTION} reports a worker that died without finishing the save"
    return True, (
        f"{CLASS}.{FUNCTION} takes a worker that died without answering for one still writing: a blocking "
        "poll waits for ever, and the other ranks wait in its all-reduce"
    )
