"""Patch, rebind and revert primitives.

Rules every fix relies on:

* A replacement is a plain module-level function (never a proxy object), so Megatron's async
  checkpoint writer can pickle it by reference into ``spawn`` workers; where a fix replaces a
  module another module imported (its ``np``), the replacement is a module of the fix's own.
* The object a replacement stands in for is kept in :data:`_ORIGINALS` for the life of the process,
  even after ``revert()``: a caller that captured the replacement earlier still reaches the
  original through :func:`original`.
* A replacement carries ``__mcore_ckpt_fix__`` so a second apply can see it is already in place and
  never stacks a second layer. Another fix's replacement in the same place is refused at apply, with
  both fixes named: two fixes on one attribute would need layers that call each other, which the
  engine does not build (one fix may wrap an attribute; that fix covers every defect there).
"""

from __future__ import annotations

import importlib
import sys
import types

_MISSING = object()
MARK = "__mcore_ckpt_fix__"

# (owner, attribute name) -> the object found there before the first patch.
_ORIGINALS = {}  # (id(owner), name) -> original object
_OWNERS = {}  # keeps owners alive so their id() keys stay valid


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
    current = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    if current is _MISSING:
        current = getattr(owner, name)
    if is_replacement(current):
        raise RuntimeError(f"mcore_ckpt_fixes: original of {owner!r}.{name} was not recorded")
    return current


class ReplacementConflict(RuntimeError):
    """Two fixes replace one attribute."""


class _Record:
    __slots__ = ("owner", "name", "before", "after")

    def __init__(self, owner, name, before, after):
        self.owner = owner
        self.name = name
        self.before = before  # _MISSING when the attribute was only inherited
        self.after = after


class Patcher:
    """Collects the changes one fix makes so that they can be undone exactly."""

    def __init__(self, fix_id: str) -> None:
        self.fix_id = fix_id
        self.records = []

    def replace(self, owner, name: str, new) -> None:
        """Set ``owner.name = new`` (owner: module or class), remembering what was there."""
        before = owner.__dict__.get(name, _MISSING)
        if before is not _MISSING and is_replacement(before):
            holder = getattr(before, MARK)
            if holder == self.fix_id or before is new:
                return  # already in place (ours, or a replacement several fixes share): one layer only
            raise ReplacementConflict(
                f"{getattr(owner, '__name__', owner)}.{name} already holds {holder}'s replacement; "
                f"{self.fix_id} cannot replace it too"
            )
        if before is _MISSING and not hasattr(owner, name):
            raise AttributeError(f"{getattr(owner, '__name__', owner)} has no attribute {name!r}")
        key = _key(owner, name)
        if key not in _ORIGINALS:
            _ORIGINALS[key] = before if before is not _MISSING else getattr(owner, name)
            _OWNERS[id(owner)] = owner
        setattr(owner, name, new)
        self.records.append(_Record(owner, name, before, new))

    def replace_function(self, module, name: str, new) -> None:
        """Replace a module-level function and every ``from module import name`` binding of it."""
        old = module.__dict__.get(name, _MISSING)
        self.replace(module, name, new)
        if old is not _MISSING and not is_replacement(old):
            self.rebind(old, new, skip=module)

    def rebind(self, old, new, skip=None) -> None:
        """Point every module global that is ``old`` (by identity) at ``new``."""
        from .bindings import holders  # an index: walking every module's globals per call is slow

        for mod, attr in holders(old):
            if mod is not skip:
                self.replace(mod, attr, new)

    def revert(self, sweep: bool = True) -> dict:
        """Undo every change. Returns ``{id(replacement): (replacement, original)}`` for the
        replacements that late imports may have bound; with ``sweep=False`` the caller sweeps once
        for several patchers (:func:`unbind_late_imports`): a sweep walks every module's globals."""
        from .bindings import note

        restore = {}
        for rec in reversed(self.records):
            if rec.before is _MISSING:
                try:
                    delattr(rec.owner, rec.name)
                except AttributeError:
                    pass
            else:
                setattr(rec.owner, rec.name, rec.before)
                note(rec.owner, rec.name, rec.before)
                if is_replacement(rec.after) and not is_replacement(rec.before):
                    restore[id(rec.after)] = (rec.after, rec.before)
        self.records.clear()
        if sweep:
            unbind_late_imports(restore)
        return restore


def _is_definition(namespace, attr, replacement) -> bool:
    """Whether ``namespace[attr]`` is where the replacement is defined, which keeps it, not a binding
    of it: a function's own module, or a replacement module's parent package (the submodule attribute)."""
    if isinstance(replacement, types.ModuleType):
        return f"{namespace.get('__name__')}.{attr}" == replacement.__name__
    return namespace.get("__name__") == getattr(replacement, "__module__", None)


def unbind_late_imports(restore) -> None:
    """A module imported while a fix was applied bound a replacement itself with ``from x import
    f``: no record covers it. Point such globals back at the original too, so after ``revert()`` no
    module calls a reverted fix. ``restore``: ``{id(replacement): (replacement, original)}``."""
    from .bindings import note

    if restore:
        for mod in list(sys.modules.values()):
            namespace = getattr(mod, "__dict__", None) if mod is not None else None
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                pair = restore.get(id(value))
                if pair is not None and value is pair[0] and not _is_definition(namespace, attr, value):
                    namespace[attr] = pair[1]
                    note(mod, attr, pair[1])
