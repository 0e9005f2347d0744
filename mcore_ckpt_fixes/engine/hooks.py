"""Post-import hooks: run a callback right after a named module finishes executing.

A small ``sys.meta_path`` finder instead of ``wrapt.register_post_import_hook``: importing wrapt 2.x
pulls in asyncio and importlib.metadata (~40 ms here), which alone would break the budget of
``import mcore_ckpt_fixes`` costing under 1 % of ``import megatron.core``. The mechanism is the same
one wrapt uses: find the real spec through the other finders, then wrap its loader's exec_module.
"""

from __future__ import annotations

import sys
import threading

_HOOKS = {}  # module name -> list of callbacks(module)
_LOCK = threading.RLock()
# Imports of these packages are tracked (depth below), so that work which cannot run while one of
# their modules is half-initialised (a probe that builds a Megatron module whose import is still
# running higher up the stack) waits until the outermost such import has finished.
TRACKED_PACKAGES = ("megatron",)
_DEPTH = threading.local()
_SETTLED = []  # callbacks waiting for the tracked imports of this thread to finish


def importing() -> bool:
    """Is a tracked import (a Megatron module's body) still running in this thread?"""
    return getattr(_DEPTH, "n", 0) > 0


def when_settled(callback) -> None:
    """Call ``callback()`` once no tracked import is running in this thread (at once if none is)."""
    if not importing():
        callback()
        return
    with _LOCK:
        _SETTLED.append(callback)


# Module name -> (the module, the last module that had finished importing when it started, the
# modules whose bodies were running then: the import chain that brought it in). importlib moves a
# module to the end of sys.modules when its body has run, so every module that ran after that
# moment sits after that last one: with the chain, these are the modules that can bind its functions
# by name (engine/bindings.py).
_IMPORTERS = {}


def finished(module) -> bool:
    """Has the module's body run to its end? Not while importlib runs it, and never for the script
    (``__main__``), whose body runs for as long as the job."""
    spec = getattr(module, "__spec__", None)
    return getattr(module, "__name__", None) != "__main__" and not getattr(spec, "_initializing", False)


def running_modules(frame):
    """The modules whose bodies are running in ``frame`` and the frames that called it."""
    running = []
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            module = sys.modules.get(frame.f_globals.get("__name__"))
            if module is not None and getattr(module, "__dict__", None) is frame.f_globals:
                running.append(module)
        frame = frame.f_back
    return running


def _last_finished(module):
    try:  # from the end, without copying sys.modules (a few steps: past the running modules)
        return next((m for m in reversed(sys.modules.values()) if m is not module and finished(m)), None)
    except RuntimeError:  # another thread imported meanwhile
        return next((m for m in reversed(list(sys.modules.values())) if m is not module and finished(m)), None)


def _record_importers(module) -> None:
    _IMPORTERS[module.__name__] = (module, _last_finished(module), running_modules(sys._getframe(2)))


def importers(name):
    """(module, the last module finished before it started, its import chain) for a module whose
    loader these hooks wrapped (Megatron's, the targets'), or None."""
    return _IMPORTERS.get(name)


class _Loader:
    """Delegates to the real loader, fires the hooks once the module has executed, and runs the
    callbacks that wait for the outermost tracked import to finish."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        _record_importers(module)
        _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        try:
            self._loader.exec_module(module)
        finally:
            _DEPTH.n -= 1
        if module.__name__ in _HOOKS:
            fire(module.__name__, sys.modules.get(module.__name__, module))
        if not importing():
            with _LOCK:
                waiting, _SETTLED[:] = list(_SETTLED), []
            for cb in waiting:
                cb()

    def __getattr__(self, name):  # get_source, is_package, ... for tools that ask the loader
        return getattr(self._loader, name)


class _Finder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS and fullname.partition(".")[0] not in TRACKED_PACKAGES:
            return None
        for finder in list(sys.meta_path):  # the finders that would have found it without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def register(name: str, callback) -> None:
    """Call ``callback(module)`` after ``import name``; at once if it is imported already."""
    with _LOCK:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        _HOOKS.setdefault(name, []).append(callback)
    module = sys.modules.get(name)
    if module is not None:
        callback(module)


def fire(name: str, module) -> None:
    with _LOCK:
        callbacks = list(_HOOKS.get(name, ()))
    for cb in callbacks:
        cb(module)
