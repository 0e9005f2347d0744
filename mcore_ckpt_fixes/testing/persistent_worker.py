"""Megatron's persistent checkpoint worker (``--use-persistent-ckpt-worker``) on a CPU host, in test
and selftest worlds only.

The worker is a ``spawn`` child whose loop starts with ``torch.cuda.set_device(rank %
torch.cuda.device_count())``: with no GPU that divides by zero, and the worker dies before it takes
any request. :func:`on_cpu` starts it through :func:`cpu_async_loop` instead, which gives the child a
one-device CUDA stand-in for those two calls (and for the synchronize after a preload's copies) and
then runs the release's own loop; a worker whose loop raises exits at once (``os._exit``) instead of
tearing its interpreter down. Everything else the worker does is Megatron's.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading

CLASS = "PersistentAsyncCaller"


def _async_utils():
    import importlib

    return importlib.import_module("megatron.core.dist_checkpointing.strategies.async_utils")


def cpu_async_loop(*args, **kwargs):
    """The worker's entry point in the ``spawn`` child (pickled by reference): the release's
    ``async_loop``, after ``set_device`` and ``device_count`` stand in for a one-GPU host."""
    import torch

    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda device=None: None  # after the preload's device-to-host copies
    try:
        return getattr(_async_utils(), CLASS).async_loop(*args, **kwargs)
    except BaseException:
        # A worker that failed exits at once, as a hard exit does: tearing its interpreter down at the
        # low CPU priority the release gives it can outlast a test's deadline on a loaded host.
        import os
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


@contextlib.contextmanager
def on_cpu():
    """Inside the block, a persistent worker this rank starts runs :func:`cpu_async_loop`; on the
    way out every worker process this rank started is killed (a healthy one waits for requests for
    ever, and the launcher joins a rank's children before it exits)."""
    cls = getattr(_async_utils(), CLASS)
    release_loop = cls.__dict__["async_loop"]
    cls.async_loop = staticmethod(cpu_async_loop)
    try:
        yield
    finally:
        cls.async_loop = release_loop
        for child in multiprocessing.active_children():
            child.kill()
            child.join(timeout=10)


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a daemon thread: its value, or its exception re-raised; a
    ``TimeoutError`` where it has not returned after ``seconds`` (it is left waiting: a rank that
    hangs in a collective cannot be unblocked, the rank reports and exits)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not return within {seconds:g} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")
