"""persistent-worker-cpu-snapshot in a job: the layer on ``PersistentAsyncCaller.schedule_async_call``
and the probe. Why: doc.md.

The request a rank hands its persistent worker carries the tensors to write: GPU tensors, which the
worker copies to the host before the trainer goes on (the preload), and CPU tensors, which a
multiprocessing queue shares with the worker rather than copies. Here every CPU tensor in the
request (its arguments and its preload's) is replaced by a clone before the release hands it over:
what the worker writes is what the tensors held when the save was scheduled.
"""

from __future__ import annotations

import functools
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import with_globals
from .. import CLASS, FUNCTION, ID, MODULE


def snapshot(value, memo: dict):
    """``value`` with every CPU tensor in it (through lists, tuples, named tuples, dicts and
    ``functools.partial``) replaced by a clone; a tensor met twice gets one clone (``memo``)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            return value
        if id(value) not in memo:
            memo[id(value)] = value.detach().clone()
        return memo[id(value)]
    if isinstance(value, functools.partial):
        return functools.partial(value.func, *snapshot(value.args, memo), **snapshot(value.keywords, memo))
    if isinstance(value, tuple):
        items = [snapshot(item, memo) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [snapshot(item, memo) for item in value]
    if isinstance(value, dict):
        return {key: snapshot(item, memo) for key, item in value.items()}
    return value


def with_cpu_tensors_copied(async_req):
    """The request with its arguments' and its preload's CPU tensors cloned."""
    memo = {}
    return async_req._replace(
        async_fn_args=snapshot(tuple(async_req.async_fn_args), memo),
        async_fn_kwargs=snapshot(dict(async_req.async_fn_kwargs or {}), memo),
        preload_fn=snapshot(async_req.preload_fn, memo),
    )


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def schedule_async_call(release, self, async_req):
    """The release hands the request to the worker; here its CPU tensors are cloned first."""
    if async_req.async_fn is None:
        return release(self, async_req)
    return release(self, with_cpu_tensors_copied(async_req))


# -- probe: the release's hand-over on a stand-in caller ---------------------------------------------


class _Queue:
    """Records what the release puts; a join that returns at once (no worker here)."""

    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)

    def join(self):
        pass


class _Alive:
    def is_alive(self):
        return True


def release_hands_over_the_tensor(cls, request_type) -> bool:
    """The release's ``schedule_async_call`` of a request whose argument is a CPU tensor, on a caller
    built without ``__init__`` (no queues, no worker): is the tensor the worker gets the trainer's own?"""
    import torch

    tensor = torch.zeros(4)
    queue = _Queue()
    caller = object.__new__(type("ProbeCaller", (cls,), {"__del__": lambda self: None}))
    caller.process, caller.start_time, caller.cur_item, caller.cur_idx = _Alive(), None, None, -1
    caller.queue = caller._persistent_queue = queue
    caller.preload_q = caller._persistent_preload_q = _Queue()
    # The release logs torch.distributed.get_rank(): a probe may run before any process group exists.
    ranks = types.SimpleNamespace(distributed=types.SimpleNamespace(get_rank=lambda: 0))
    schedule = with_globals(original(cls, FUNCTION), torch=ranks)
    schedule(caller, request_type(async_fn=print, async_fn_args=(tensor,), finalize_fns=[]))
    (sent,) = [item for item in queue.items if not isinstance(item, str)]
    return sent.async_fn_args[0] is tensor


def probe(module: types.ModuleType):
    cls, request_type = module.__dict__.get(CLASS), module.__dict__.get("AsyncRequest")
    if cls is None or FUNCTION not in cls.__dict__ or request_type is None:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION} or AsyncRequest"
    if not release_hands_over_the_tensor(cls, request_type):
        return False, f"{CLASS}.{FUNCTION} hands the worker copies of the request's CPU tensors"
    return True, (
        f"{CLASS}.{FUNCTION} hands the worker the trainer's own CPU tensors (shared, not copied): the "
        "trainer's next in-place updates reach the checkpoint"
    )
