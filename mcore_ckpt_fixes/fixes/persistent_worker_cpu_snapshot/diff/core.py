"""persistent-worker-cpu-snapshot as Megatron-Core would carry it, in
``megatron/core/dist_checkpointing/strategies/async_utils.py``: ``PersistentAsyncCaller.schedule_async_call``
hands the worker a request whose CPU tensors (in its arguments and its preload's) are clones, made
by ``_with_cpu_tensors_copied`` (inserted above the class), as runtime/core.py's layer does before
the release's call. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from packaging.version import Version

from ....sourcediff import Replace, insert_before

ASYNC_UTILS = "megatron/core/dist_checkpointing/strategies/async_utils.py"

_HELPERS = '''def _cpu_tensors_copied(value, memo):
    """``value`` with every CPU tensor in it (through lists, tuples, dicts and partials) replaced by
    a clone; a tensor met twice gets one clone."""
    import functools

    if isinstance(value, torch.Tensor):
        if value.device.type != 'cpu':
            return value
        if id(value) not in memo:
            memo[id(value)] = value.detach().clone()
        return memo[id(value)]
    if isinstance(value, functools.partial):
        args, keywords = _cpu_tensors_copied(value.args, memo), _cpu_tensors_copied(value.keywords, memo)
        return functools.partial(value.func, *args, **keywords)
    if isinstance(value, tuple):
        items = [_cpu_tensors_copied(item, memo) for item in value]
        return type(value)(*items) if hasattr(value, '_fields') else tuple(items)
    if isinstance(value, list):
        return [_cpu_tensors_copied(item, memo) for item in value]
    if isinstance(value, dict):
        return {key: _cpu_tensors_copied(item, memo) for key, item in value.items()}
    return value


def _with_cpu_tensors_copied(async_req):
    """The request with its CPU tensors cloned: a queue shares a CPU tensor with the persistent
    worker instead of copying it, and the trainer goes on changing it before the worker writes."""
    memo = {}
    return async_req._replace(
        async_fn_args=_cpu_tensors_copied(tuple(async_req.async_fn_args), memo),
        async_fn_kwargs=_cpu_tensors_copied(dict(async_req.async_fn_kwargs or {}), memo),
        preload_fn=_cpu_tensors_copied(async_req.preload_fn, memo),
    )


'''


def source_edits(release: str) -> list:
    # The worker's request queue is the caller's own before 0.17, the class's from 0.17.
    queue = "self.queue" if Version(release) < Version("0.17.0") else "self._persistent_queue"
    put = f"        {queue}.put(async_req)\n"
    return [
        insert_before(ASYNC_UTILS, "class PersistentAsyncCaller(AsyncCaller):\n", _HELPERS),
        Replace(ASYNC_UTILS, put, "        async_req = _with_cpu_tensors_copied(async_req)\n" + put),
    ]
