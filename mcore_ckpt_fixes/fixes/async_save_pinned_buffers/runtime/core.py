"""async-save-pinned-buffers in a job: the layers on ``TemporalAsyncCaller.schedule_async_call`` and
``close``, and the probe. Why: the package's docstring, in full: doc.md.

The release runs the request's preload (the device-to-host copies into pinned memory) in
``schedule_async_call``, hands the copies to the writer process it forks, and keeps no reference to
them: they are freed as the call returns, while the writer still reads them. Here the preload runs
first, its result stays on the caller, and the release is handed the request with the copies in
place of its preload; ``close``, once the release has joined (or killed) the writer, lets them go.
"""

from __future__ import annotations

import dis
import inspect
import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, CLOSE, FUNCTION, ID, MODULE

STAGED = "_mcore_ckpt_fixes_staged"  # the caller's attribute that holds the staged copies
# What the release's schedule_async_call keeps on the caller where it keeps nothing of the preload.
RELEASE_KEEPS = {"process", "start_time"}


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def schedule_async_call(below_us, self, async_req):
    """The preload run here and its result held by the caller until :func:`close` has joined the
    writer; the release forks the writer with that result (a request without a preload is the
    release's own)."""
    if async_req.async_fn is None or async_req.preload_fn is None:
        return below_us(self, async_req)
    args = list(async_req.async_fn_args)
    args[1] = async_req.preload_fn()
    setattr(self, STAGED, args[1])
    try:
        return below_us(self, async_req._replace(async_fn_args=tuple(args), preload_fn=None))
    except BaseException:
        setattr(self, STAGED, None)  # no writer was started with them
        raise


@layer(ID, MODULE, CLOSE, owner=CLASS)
def close(below_us, self, *args, **kwargs):
    """The release's close; once it has no writer left (joined, or killed on abort), the staged
    copies that writer read are let go."""
    try:
        return below_us(self, *args, **kwargs)
    finally:
        if getattr(self, "process", None) is None:
            setattr(self, STAGED, None)


def _stored_attributes(fn) -> set:
    return {i.argval for i in dis.get_instructions(inspect.unwrap(fn)) if i.opname == "STORE_ATTR"}


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in vars(cls) or CLOSE not in vars(cls):
        return None, f"{MODULE} has no {CLASS}.{FUNCTION} and {CLOSE}"
    release = inspect.unwrap(original(cls, FUNCTION))
    names = set(release.__code__.co_names)
    if not {"preload_fn", "Process", "start"} <= names:
        return None, f"{CLASS}.{FUNCTION} is not the preload-then-fork this fix knows"
    kept = _stored_attributes(release) - RELEASE_KEEPS
    if kept:
        return False, f"{CLASS}.{FUNCTION} keeps the preloaded copies on the caller ({', '.join(sorted(kept))})"
    return True, (
        f"{CLASS}.{FUNCTION} forks the writer with the preloaded pinned copies and keeps no reference to them: "
        "freed while the writer reads them, and reused by the trainer's next device-to-host copies"
    )
