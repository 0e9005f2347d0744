"""Which module globals hold a given function, without walking every module's globals each time.

Rebinding a replaced function (``from x import f`` elsewhere) needs every module global that is the
original, by identity. A process that imported torch and Megatron-Core has ~3,300 modules and
~130,000 globals; walking them all for each of the dozen functions the fixes replace cost more
than all the fixes' probes together. Two things keep it small:

* Where the import hooks saw the function's module imported (every Megatron module imported after
  this package), only the modules that can have bound the function by name are looked at: those
  whose bodies ran after its module started (importlib moves a module to the end of ``sys.modules``
  once its body has run, so they all sit after the last module that had finished by then, which
  the hooks record), the import chain that brought its module in, the modules whose bodies are
  running at the lookup (found on the call stack) and ``__main__``. Any other module had finished
  importing before the function existed.
* Each namespace is walked once and what it binds from other modules is remembered, as an index
  ``id(function) -> {(module, name)}``; it is walked again only when its size changes or while its
  module is still executing (``__spec__._initializing``, set by importlib while the body runs). A
  module's own functions, most of its globals, are not indexed: the module that defines a function
  is walked on every lookup. Every hit is checked against the namespace as it is now.

What this cannot see: a global reassigned, by code outside this package after its module finished
importing, to a function it did not hold before, with no new global beside it (and, for a function
whose module the hooks saw, such a binding in a module imported before that one).
:func:`forget` drops the index; ``revert`` rebinds names without changing sizes, so it tells the
index what it put back (:func:`note`) instead of dropping it (a rebuild costs a second a process).
"""

from __future__ import annotations

import sys
import types

from .hooks import finished, importers, running_modules

_WHERE = {}  # id(function) -> {(id(module), name)} seen holding it (checked again on use)
_MODULES = {}  # id(module) -> module, for the ids above (held: their ids stay theirs)
_TRUSTED = {}  # id(module) -> (namespace, its size when walked), for modules whose body had run
# sys.modules as last looked at: its size and last module (a module imported, finished or removed
# since changes one of them), its modules in order and each one's position.
_SEEN = {"size": -1, "last": None, "position": {}, "modules": []}


def forget() -> None:
    _WHERE.clear()
    _MODULES.clear()
    _TRUSTED.clear()
    _SEEN.update(size=-1, last=None, position={}, modules=[])


def note(module, name, function) -> None:
    """``module.name`` now holds ``function`` again (set back by ``revert``): index it, since the
    namespace's size did not change and a walk would not look again."""
    if type(function) is types.FunctionType and isinstance(module, types.ModuleType):
        _MODULES[id(module)] = module
        _WHERE.setdefault(id(function), set()).add((id(module), name))


def index_module(module, namespace) -> None:
    key = id(module)
    _MODULES[key] = module
    # A module's own functions are most of its globals and are found by walking the one module
    # that defines a function (``holders``): only functions bound from elsewhere are indexed.
    own, function = namespace.get("__name__"), types.FunctionType
    for name, value in list(namespace.items()):
        if type(value) is function and value.__module__ != own:
            _WHERE.setdefault(id(value), set()).add((key, name))
    if finished(module):
        _TRUSTED[key] = (namespace, len(namespace))
    else:
        _TRUSTED.pop(key, None)


def _refresh() -> list:
    """sys.modules' modules (with a dict namespace), in order, and their positions in ``_SEEN``."""
    modules = list(sys.modules.values())
    size, last = _SEEN["size"], _SEEN["last"]
    if len(modules) == size and (modules[-1] if modules else None) is last:
        return _SEEN["modules"]
    if 0 < size < len(modules) and modules[size - 1] is last:
        new = modules[size:]  # only imported since: the order before is as it was
    else:
        _SEEN.update(position={}, modules=[])
        new = modules
    position, listed = _SEEN["position"], _SEEN["modules"]
    for module in new:
        if isinstance(getattr(module, "__dict__", None), dict):
            position[id(module)] = len(listed)
            listed.append(module)
    _SEEN.update(size=len(modules), last=modules[-1] if modules else None)
    return listed


def _candidates(function, modules):
    """The modules that can bind ``function`` by name: every one, unless the import hooks saw its
    module imported; then the ones whose bodies ran after its module started (those after the last
    module that had finished by then: importlib puts a module last once its body has run), the
    import chain that brought its module in, the ones whose bodies are running now (the imports in
    progress) and ``__main__``."""
    seen = importers(getattr(function, "__module__", None))
    if seen is None or id(seen[0]) not in _SEEN["position"]:
        return modules
    start = _SEEN["position"].get(id(seen[1]), -1) + 1 if seen[1] is not None else 0
    script = [sys.modules["__main__"]] if "__main__" in sys.modules else []
    return [*seen[2], *script, *running_modules(sys._getframe(1)), *modules[start:]]


def holders(function):
    """[(module, name)] of every global of a module in ``sys.modules`` that is ``function`` now,
    in ``sys.modules`` order."""
    if type(function) is not types.FunctionType:
        return _holders_by_walking(function)  # not indexed: walk everything
    modules = _refresh()
    for module in _candidates(function, modules):
        namespace = module.__dict__
        trusted = _TRUSTED.get(id(module))
        if trusted is None or trusted[0] is not namespace or trusted[1] != len(namespace):
            index_module(module, namespace)
    position = _SEEN["position"]
    found = {
        (position[key], name, key)
        for key, name in _WHERE.get(id(function), ())
        if key in position and vars(_MODULES[key]).get(name) is function
    }
    home = sys.modules.get(getattr(function, "__module__", None))
    if home is not None and id(home) in position:  # where it is defined (its own functions: not indexed)
        found.update(
            (position[id(home)], name, id(home)) for name, value in list(vars(home).items()) if value is function
        )
        _MODULES[id(home)] = home
    return [(_MODULES[key], name) for _, name, key in sorted(found)]


def _holders_by_walking(obj):
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None) if module is not None else None
        if isinstance(namespace, dict):
            found.extend((module, name) for name, value in list(namespace.items()) if value is obj)
    return found
