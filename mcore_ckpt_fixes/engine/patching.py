"""Patch, rebind and revert primitives.

Rules every fix relies on:

* A replacement is a plain module-level function (never a proxy object), so Megatron's async
  checkpoint writer can pickle it by reference into ``spawn`` workers; where a fix replaces a
  module another module imported (its ``np``), the replacement is a module of the fix's own.
* The object a replacement stands in for is kept in :data:`_ORIGINALS` for the life of the process,
  even after ``revert()``: a caller that captured the replacement earlier still reaches the
  original through :func:`original`.
* A replacement carries ``__mcore_ckpt_fix__``, the id of the fix that owns it.
* Replacements compose. Several fixes may replace one attribute: each is a layer, and a layer
  reaches the one under it with :func:`below` (the release's object under the lowest layer), never
  the original directly. The attribute holds the top layer. Layers stand in the order the registry
  declares (``mcore_ckpt_fixes.fixes.ORDER``: a fix listed earlier sits lower, nearer the
  release), whatever order they were applied in; a fix has one layer per attribute however often it
  applies, and ``revert()`` of one fix takes out exactly its layers. An attribute holding a marked
  replacement that no layer here put there (another copy of this package, code that put a reverted
  replacement back) cannot be layered on: :class:`ReplacementConflict`, naming both fixes.
"""

from __future__ import annotations

import importlib
import sys
import types

MISSING = object()
MARK = "__mcore_ckpt_fix__"

# (owner, attribute name) -> the object found there before the first patch.
_ORIGINALS = {}  # (id(owner), name) -> original object
_OWNERS = {}  # keeps owners alive so their id() keys stay valid
_STACKS = {}  # (id(owner), name) -> _Stack: the layers in place there now


def mark(fix_id: str):
    """Decorator for replacement functions: tag them with the fix that owns them."""

    def deco(fn):
        setattr(fn, MARK, fix_id)
        return fn

    return deco


def is_replacement(obj) -> bool:
    return getattr(obj, MARK, None) is not None


def _key(owner, name: str):
    return (id(owner), name)


def _where(owner, name: str) -> str:
    return f"{getattr(owner, '__name__', owner)}.{name}"


def original(owner, name: str):
    """The object ``owner.name`` held before any fix replaced it.

    ``owner`` may be a module name: it is imported first, which in a fresh ``spawn`` child also runs
    the post-import hook that records the original.
    """
    if isinstance(owner, str):
        owner = importlib.import_module(owner)
    try:
        return _ORIGINALS[_key(owner, name)]
    except KeyError:
        pass
    current = owner.__dict__.get(name, MISSING) if hasattr(owner, "__dict__") else MISSING
    if current is MISSING:
        current = getattr(owner, name)
    if is_replacement(current):
        raise RuntimeError(f"mcore_ckpt_fixes: original of {owner!r}.{name} was not recorded")
    return current


def below(fix_id: str, owner, name: str):
    """What ``fix_id``'s layer on ``owner.name`` stands on: the next fix's layer down, or the
    release's object. A replacement calls this, not :func:`original`, so that a fix layered under it
    still runs. Where ``fix_id`` has no layer (reverted while a caller kept the replacement, or a
    ``spawn`` child that did not apply it) this is the original."""
    if isinstance(owner, str):
        owner = importlib.import_module(owner)
    stack = _STACKS.get(_key(owner, name))
    if stack is not None:
        for position, layer in enumerate(stack.layers):
            if layer.fix_id == fix_id:
                if position:
                    return stack.layers[position - 1].value
                break
    return original(owner, name)


def layers(owner, name: str):
    """``[(fix id, replacement)]`` on ``owner.name`` now, lowest first (the top is what it holds)."""
    stack = _STACKS.get(_key(owner, name))
    return [(layer.fix_id, layer.value) for layer in stack.layers] if stack is not None else []


def has_layer(fix_id: str, owner, name: str) -> bool:
    """Whether ``fix_id`` has a layer on ``owner.name`` now."""
    stack = _STACKS.get(_key(owner, name))
    return stack is not None and any(layer.fix_id == fix_id for layer in stack.layers)


class ReplacementConflict(RuntimeError):
    """An attribute holds a replacement no layer of this engine put there."""


class _Layer:
    __slots__ = ("fix_id", "rank", "value")

    def __init__(self, fix_id, rank, value):
        self.fix_id, self.rank, self.value = fix_id, rank, value


class _Stack:
    """The layers on one attribute, lowest first, and what the attribute held under them."""

    __slots__ = ("base", "layers")

    def __init__(self, base):
        self.base = base  # MISSING when the attribute was only inherited
        self.layers = []

    def copy(self):
        twin = _Stack(self.base)
        twin.layers = list(self.layers)
        return twin

    def top(self):
        return self.layers[-1].value if self.layers else self.base


class _Record:
    __slots__ = ("owner", "name", "before", "after")

    def __init__(self, owner, name, before, after):
        self.owner = owner
        self.name = name
        self.before = before  # the release's object there (MISSING when it was only inherited)
        self.after = after  # this fix's layer


def _set(owner, name: str, value) -> None:
    from .bindings import note

    if value is MISSING:
        try:
            delattr(owner, name)
        except AttributeError:
            pass
        return
    setattr(owner, name, value)
    note(owner, name, value)  # a setattr keeps the namespace's size: tell the bindings index


class Patcher:
    """Collects the changes one fix makes so that they can be undone exactly.

    ``rank``: where the fix's layers stand among other fixes' layers on one attribute (lower
    first): its place in the registry's declared order."""

    def __init__(self, fix_id: str, rank: int = 0) -> None:
        self.fix_id = fix_id
        self.rank = rank
        self.records = []

    def _stack(self, owner, name: str, current, like=None):
        """The layers on ``owner.name``, started with ``current`` as their base if there are none.
        ``like``: the layers of the attribute this one binds by name, for a global that took their
        top with ``from x import f`` after they went on (no record of ours covers it)."""
        key = _key(owner, name)
        stack = _STACKS.get(key)
        if stack is not None and stack.top() is not current:
            # Code outside the engine set the attribute since the layers went on (a module reload,
            # an assignment): they are gone from it, and what is there now is the new base.
            del _STACKS[key]
            stack = None
        if stack is not None:
            return stack
        if like is not None and like.layers and like.top() is current:
            stack = _STACKS[key] = like.copy()
            stack.layers = [layer for layer in stack.layers if layer.fix_id != self.fix_id]  # ours goes on next
            _OWNERS[id(owner)] = owner
            return stack
        if current is not MISSING and is_replacement(current):
            raise ReplacementConflict(
                f"{_where(owner, name)} holds {getattr(current, MARK)}'s replacement, which no layer here put "
                f"there; {self.fix_id} cannot layer on it"
            )
        if current is MISSING and not hasattr(owner, name):
            raise AttributeError(f"{getattr(owner, '__name__', owner)} has no attribute {name!r}")
        if key not in _ORIGINALS:
            _ORIGINALS[key] = current if current is not MISSING else getattr(owner, name)
            _OWNERS[id(owner)] = owner
        stack = _STACKS[key] = _Stack(current)
        return stack

    def replace(self, owner, name: str, new, like=None, bound_from=None) -> None:
        """Put ``new`` on ``owner.name`` (owner: module or class) as this fix's layer.
        ``bound_from``: ``(module, name)`` that ``owner.name`` binds by name (``from module import
        name``), already replaced: its layers, ours included, may be what ``owner.name`` took."""
        if bound_from is not None and like is None:
            like = _STACKS.get(_key(*bound_from))
        current = owner.__dict__.get(name, MISSING)
        stack = self._stack(owner, name, current, like)
        if any(layer.fix_id == self.fix_id or layer.value is new for layer in stack.layers):
            return  # already in place (ours, or a replacement several fixes share): one layer only
        at = len(stack.layers)
        while at and stack.layers[at - 1].rank > self.rank:
            at -= 1
        stack.layers.insert(at, _Layer(self.fix_id, self.rank, new))
        if stack.top() is not current:
            _set(owner, name, stack.top())
        self.records.append(_Record(owner, name, stack.base, new))

    def replace_function(self, module, name: str, new) -> None:
        """Replace a module-level function and every ``from module import name`` binding of it."""
        held = module.__dict__.get(name, MISSING)
        layers = _STACKS.get(_key(module, name))
        like = layers.copy() if layers is not None else None  # as they were before ours, as its bindings hold them
        self.replace(module, name, new)
        if held is not MISSING:
            self.rebind(held, new, skip=module, like=like)

    def rebind(self, old, new, skip=None, like=None) -> None:
        """Put ``new`` as this fix's layer on every module global that is ``old`` (by identity):
        the release's function, or the layer on top of it where another fix was first."""
        from .bindings import holders  # an index: walking every module's globals per call is slow

        for mod, attr in holders(old):
            if mod is not skip and not (is_replacement(old) and _is_definition(vars(mod), attr, old)):
                self.replace(mod, attr, new, like)

    def revert(self, sweep: bool = True, whole: bool = True) -> dict:
        """Take out this fix's layers. Returns ``{id(replacement): (replacement, what is there
        now)}`` for the replacements that late imports may have bound; with ``sweep=False`` the
        caller sweeps once for several patchers (:func:`unbind_late_imports`): a sweep walks every
        module's globals. ``whole``: also from the globals that bound a layer by name after it went
        on (their layers were copied from the attribute they bind, with no record of this fix);
        False for a part of the fix's changes only."""
        restore = {}
        for rec in reversed(self.records):
            current = rec.owner.__dict__.get(rec.name, MISSING)
            stack = _STACKS.get(_key(rec.owner, rec.name))
            if stack is None or stack.top() is not current or not self._take_out(rec.owner, rec.name, stack, restore):
                if current is rec.after:  # set outside the engine to our layer: put the release's back
                    _set(rec.owner, rec.name, rec.before)
        self.records.clear()
        if whole:
            for key, stack in list(_STACKS.items()):
                owner = _OWNERS.get(key[0])
                if owner is not None and stack.top() is owner.__dict__.get(key[1], MISSING):
                    self._take_out(owner, key[1], stack, restore)
        if sweep:
            unbind_late_imports(restore)
        return restore

    def _take_out(self, owner, name, stack, restore) -> bool:
        """Remove this fix's layer from ``stack`` (``owner.name``'s); False if it has none there."""
        layer = next((la for la in stack.layers if la.fix_id == self.fix_id), None)
        if layer is None:
            return False
        was_top = stack.layers[-1] is layer
        stack.layers.remove(layer)
        now = stack.top()
        if not stack.layers:
            del _STACKS[_key(owner, name)]
        if was_top:
            _set(owner, name, now)
        if is_replacement(layer.value) and now is not MISSING:
            restore[id(layer.value)] = (layer.value, now)  # a global that bound our layer: what is there now
        return True


def _is_definition(namespace, attr, replacement) -> bool:
    """Whether ``namespace[attr]`` is where the replacement is defined, which keeps it, not a binding
    of it: a function's own module, or a replacement module's parent package (the submodule attribute)."""
    if isinstance(replacement, types.ModuleType):
        return f"{namespace.get('__name__')}.{attr}" == replacement.__name__
    return namespace.get("__name__") == getattr(replacement, "__module__", None)


def unbind_late_imports(restore) -> None:
    """A module imported while a fix was applied bound a replacement itself with ``from x import
    f``: no record covers it. Point such globals at what the attribute holds now (the layer under
    the reverted one, or the original), so after ``revert()`` no module calls a reverted fix.
    ``restore``: ``{id(replacement): (replacement, what to put back)}``."""
    from .bindings import note

    if restore:
        for mod in list(sys.modules.values()):
            namespace = getattr(mod, "__dict__", None) if mod is not None else None
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                pair = restore.get(id(value))
                if pair is not None and value is pair[0] and not _is_definition(namespace, attr, value):
                    now = pair[1]
                    while id(now) in restore and restore[id(now)][0] is now:  # that layer was reverted too
                        now = restore[id(now)][1]
                    namespace[attr] = now
                    note(mod, attr, now)
