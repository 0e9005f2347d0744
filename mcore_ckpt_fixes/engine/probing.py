"""Stand-ins the fixes' behavioural probes share (nothing heavy imported)."""

from __future__ import annotations


class Group:
    """Stands in for a process group in a probe: only ``rank()`` and ``size()`` are read."""

    __slots__ = ("_rank", "_size")

    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def __repr__(self):
        return f"Group(rank={self._rank}, size={self._size})"


def _copy(fn, scope):
    import types

    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def with_globals(fn, **names):
    """A copy of the function ``fn`` that sees ``names`` in place of its module's globals of those
    names: a probe runs the release's own code as if, e.g., the release had taken another import
    branch, while the live module (which other threads may be running) is left as it is."""
    return _copy(fn, dict(fn.__globals__, **names))


def module_scope(module, **names):
    """A copy of ``module``'s globals with ``names`` in place, in which every function the module
    defines (not given in ``names``) is a copy that sees this scope: the release's code run on
    stand-ins reaches them through its helpers too, and the live module is left as it is."""
    return module_scopes({module: names})[module]


def module_scopes(overrides):
    """:func:`module_scope` for several modules at once (``{module: {name: stand-in}}``), linked: a
    function one of them binds by name from another (``from x import f``) is the other scope's
    copy, and a name given a stand-in in one is that stand-in wherever another binds it."""
    import types

    scopes = {module: dict(vars(module), **names) for module, names in overrides.items()}
    instead = {}  # id(live object) -> what the scopes hold in its place
    for module, scope in scopes.items():
        for name, stand_in in overrides[module].items():
            if name in vars(module):
                instead[id(vars(module)[name])] = stand_in
        for name, value in list(scope.items()):
            if (
                name not in overrides[module]
                and type(value) is types.FunctionType
                and value.__module__ == module.__name__
            ):
                instead[id(value)] = scope[name] = _copy(value, scope)
    for module, scope in scopes.items():
        for name, value in list(scope.items()):
            if name not in overrides[module] and id(value) in instead and vars(module).get(name) is value:
                scope[name] = instead[id(value)]
    return scopes


def in_scope(fn, scope):
    """A copy of the function ``fn`` (a method of a class, a module's function) that reads its
    globals from ``scope`` (:func:`module_scope`)."""
    return _copy(fn, scope)
