"""A replacement declared with its target once: ``@layer(ID, MODULE, "name")``.

The decorated function is the fix's layer on ``MODULE.name`` (or ``MODULE.owner.name`` for a
class attribute). It receives what lies below it as its first argument (the next fix's layer down,
or the release's object: :func:`.patching.below`, looked up at each call, since layers come and go),
then the caller's arguments. The module-level name holds the replacement itself, so it stays
picklable by reference for ``spawn`` workers (why a proxy object such as wrapt's is not used).

A target whose runtime module defines no ``apply`` gets :func:`apply_layers`: every layer the
module declares for that target module goes on, through the patcher.
"""

from __future__ import annotations

import importlib
import types

from .patching import MARK, below

# Where a replacement goes: (module name, class name or None, attribute name).
SPOT = "__mcore_ckpt_layer__"


def layer(fix_id: str, module: str, name: str, owner: str = None):
    """Declare the decorated ``fn(below, *args, **kwargs)`` as ``fix_id``'s layer on
    ``module[.owner].name``. Callers (and a layer above that reads what lies below it with
    ``inspect.signature``) see ``fn``'s signature without its first parameter."""

    def declare(fn):
        def replacement(*args, **kwargs):
            return fn(below(fix_id, _owner(module, owner), name), *args, **kwargs)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(replacement, attr, getattr(fn, attr))
        replacement.__signature__ = _without_first(fn)
        setattr(replacement, MARK, fix_id)
        setattr(replacement, SPOT, (module, owner, name))
        return replacement

    return declare


def _without_first(fn):
    import inspect  # runtime modules load with their Megatron target, which has imported it already

    signature = inspect.signature(fn)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _owner(module: str, owner):
    # import_module, not sys.modules: a spawn worker may unpickle a replacement before the target
    # module was imported there (a cached lookup once it was).
    found = importlib.import_module(module)
    return getattr(found, owner) if owner else found


def declared(runtime: types.ModuleType, module_name: str):
    """The layers ``runtime`` declares for ``module_name``: ``[(owner, name, replacement)]``."""
    found = []
    for value in vars(runtime).values():
        spot = getattr(value, SPOT, None) if isinstance(value, types.FunctionType) else None
        if spot is not None and spot[0] == module_name and (spot[1], spot[2], value) not in found:
            found.append((spot[1], spot[2], value))
    return found


def apply_layers(runtime: types.ModuleType, module: types.ModuleType, patcher) -> None:
    """Put every layer ``runtime`` declares for ``module`` in place: a module function with its
    ``from module import name`` bindings, a class attribute on its class."""
    spots = declared(runtime, module.__name__)
    if not spots:
        raise LookupError(f"{runtime.__name__} has no apply() and declares no @layer for {module.__name__}")
    for owner, name, replacement in spots:
        if owner is None:
            patcher.replace_function(module, name, replacement)
        else:
            patcher.replace(getattr(module, owner), name, replacement)
