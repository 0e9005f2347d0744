"""param-group-identity's monkeypatch on ``megatron.core.optimizer.optimizer`` and
``distrib_optimizer``: ``MegatronOptimizer._filter_and_reorder_param_groups`` and
``DistributedOptimizer.load_state_dict`` (a standalone one, as Megatron-FSDP returns, or each one a
``ChainedOptimizer`` holds, whose load and load request call it), the probe and apply. Why: the
package's docstring. Imported only when a target module is.

Both modules' ``param_group_identifier_keys`` (what their matching code iterates) become
:class:`IdentifierKeys`: the release's tuple, equal to it in every way, except that inside one of
the two replaced methods it iterates the keys :func:`_param_group_identifier_keys_for` chose for that
load. The choice lives in a context variable of this module, so a thread or task loading another
optimizer at the same time sees its own keys (or the release's); nothing is swapped during a call.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
import warnings

from ....engine.errors import MegatronPatchWarning
from ....engine.layers import layer
from ....engine.patching import MARK, Patcher, below, is_replacement, original
from ....engine.probing import in_scope, module_scope
from .. import DISTRIB_MODULE, ID, MODULE

GLOBAL = "param_group_identifier_keys"

# The keys chosen for the load running in this context; None: the release's.
_CHOSEN = contextvars.ContextVar("mcore_ckpt_fixes_param_group_identifier_keys", default=None)


class IdentifierKeys(tuple):
    """The release's ``param_group_identifier_keys``; iterated inside a load this fix matches, the
    keys chosen for it."""

    __slots__ = ()

    def __iter__(self):
        chosen = _CHOSEN.get()
        return iter(chosen) if chosen is not None else tuple.__iter__(self)

    def __repr__(self):  # the release's messages print the keys they matched by
        return repr(tuple(iter(self)))

    def __reduce__(self):
        return (tuple, (tuple(tuple.__iter__(self)),))


setattr(IdentifierKeys, MARK, ID)

# The one object both modules hold (taken from the release's tuple at the first apply).
_INSTALLED: dict = {}


def _release_keys():
    keys = _INSTALLED.get(GLOBAL)
    if keys is not None:
        return tuple(tuple.__iter__(keys))
    return tuple(tuple.__iter__(vars(sys.modules[MODULE]).get(GLOBAL, ())))


# The release's tuple, whatever a load chose (read by the helper below, whose text the source diff
# carries: in the release's module this name is its own global).
class _ReleaseKeys:
    def __iter__(self):
        return iter(_release_keys())


param_group_identifier_keys = _ReleaseKeys()


# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/optimizer.py, below param_group_identifier_keys.

# What a parameter-group override may set (ParamGroupOverride): two groups alike by
# param_group_identifier_keys may still differ in these.
_PARAM_GROUP_OVERRIDE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd", "optimizer")
# The learning-rate bounds a group takes from the run's arguments (--lr, --min-lr, --decoupled-lr),
# which a resumed run may change: where they are identifier keys, a changed one finds no saved group.
_RUN_LEARNING_RATE_KEYS = ("max_lr", "min_lr")


def _param_group_identifier_keys_for(current_groups, saved_groups):
    """The keys that match current parameter groups to saved ones: param_group_identifier_keys,
    where they give every current group exactly one saved group. Where those leave two groups alike
    (a group with its own max_lr would take another group's saved one), also the override keys every
    group carries; where a group's learning-rate bounds are keys and changed since the save (no saved
    group has them), the keys without them. Either only if it then gives every current group exactly
    one saved group; otherwise the first ones (the load refuses, or matches as it always did)."""
    base = tuple(param_group_identifier_keys)

    def identities(groups, keys):
        return [tuple(g[k] if k in g else g.get(f"pre_{k}") for k in keys) for g in groups]

    def one_each(keys):
        current, saved = identities(current_groups, keys), identities(saved_groups, keys)
        return len(set(current)) == len(current) and len(set(saved)) == len(saved) and set(current) <= set(saved)

    def distinct(ids):
        return len(set(ids)) == len(ids)

    if distinct(identities(current_groups, base)) and distinct(identities(saved_groups, base)):
        without_lrs = tuple(k for k in base if k not in _RUN_LEARNING_RATE_KEYS)
        if not one_each(base) and without_lrs != base and one_each(without_lrs):
            return without_lrs
        return base
    every_group = list(current_groups) + list(saved_groups)
    extra = tuple(k for k in _PARAM_GROUP_OVERRIDE_KEYS if k not in base and all(k in g for g in every_group))
    if one_each(base + extra):
        return base + extra
    return base


# -- end of replacement ---


@contextlib.contextmanager
def matching_by_keys(keys):
    """Inside the block, this context's matching iterates ``keys`` (the release's: nothing set)."""
    token = _CHOSEN.set(tuple(keys)) if tuple(keys) != _release_keys() else None
    try:
        yield
    finally:
        if token is not None:
            _CHOSEN.reset(token)


def _warn_if_still_alike(current_groups, keys):
    base = tuple(_release_keys())
    ids = [tuple(g.get(k, g.get(f"pre_{k}")) for k in base) for g in current_groups]
    if tuple(keys) == base and len(set(ids)) != len(ids):
        warnings.warn(
            f"mcore_ckpt_fixes: {ID}: parameter groups alike by {base} differ in their overrides and do not "
            "match the checkpoint's (an override changed since the save): they resume with one saved "
            "group's max_lr/min_lr, as Megatron-Core before 0.19 does",
            MegatronPatchWarning,
            stacklevel=4,
        )


def _keys_for(current_groups, saved_groups):
    keys = _param_group_identifier_keys_for(current_groups, saved_groups)
    _warn_if_still_alike(current_groups, keys)
    return keys


def filter_and_reorder_param_groups(current_groups, state_dict_groups):
    """``MegatronOptimizer._filter_and_reorder_param_groups`` (a staticmethod; the non-distributed
    optimizers' load) matching by the keys that tell the groups apart."""
    below_us = below(ID, sys.modules[MODULE].MegatronOptimizer, "_filter_and_reorder_param_groups")
    with matching_by_keys(_keys_for(current_groups, state_dict_groups)):
        return below_us(current_groups, state_dict_groups)


@layer(ID, DISTRIB_MODULE, "load_state_dict", owner="DistributedOptimizer")
def distrib_load_state_dict(below_us, self, state_dict):
    """``DistributedOptimizer.load_state_dict`` matching the checkpoint's parameter groups to the
    optimizer's by the keys that tell them apart (a load request loads the optimizer's own state
    into itself through here too)."""
    inner = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
    saved = inner.get("param_groups") if isinstance(inner, dict) else None
    current = getattr(getattr(self, "optimizer", None), "param_groups", None)
    if not isinstance(saved, list) or current is None:
        return below_us(self, state_dict)
    with matching_by_keys(_keys_for(current, saved)):
        return below_us(self, state_dict)


setattr(filter_and_reorder_param_groups, MARK, ID)
STATIC_FILTER = staticmethod(filter_and_reorder_param_groups)
setattr(STATIC_FILTER, MARK, ID)


# -- probe: the release's own matching on two groups that differ only in max_lr ---------------------


def _release_filter(cls):
    fn = cls.__dict__["_filter_and_reorder_param_groups"]
    fn = original(cls, "_filter_and_reorder_param_groups") if is_replacement(fn) else fn
    return fn.__func__ if isinstance(fn, staticmethod) else fn


def _group(params, max_lr, min_lr=0.0, wd_mult=1.0):
    return {"params": params, "wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False,
            "is_decoupled_lr": False, "max_lr": max_lr, "min_lr": min_lr}  # fmt: skip


def gives_alike_groups_one_saved_group(module) -> bool:
    current = [_group([0], 1.0), _group([1], 3.0)]
    saved = [_group([0], 1.0), _group([1], 3.0)]
    out = _release_filter(module.MegatronOptimizer)(current, saved)
    return [g["max_lr"] for g in out] != [1.0, 3.0]


def refuses_a_changed_learning_rate(module) -> bool:
    """A run resumed with another --lr / --min-lr: its groups (weight decay on and off) carry the new
    bounds, the checkpoint's the old ones. Does the release find no saved group for them?"""
    current = [_group([0], 2.0, 0.2), _group([1], 2.0, 0.2, wd_mult=0.0)]
    saved = [_group([0], 1.0, 0.1), _group([1], 1.0, 0.1, wd_mult=0.0)]
    try:
        _release_filter(module.MegatronOptimizer)(current, saved)
    except (KeyError, ValueError):
        return True
    return False


def probe(module: types.ModuleType):
    cls = module.__dict__.get("MegatronOptimizer")
    if cls is None or "_filter_and_reorder_param_groups" not in cls.__dict__ or GLOBAL not in vars(module):
        return None, f"{MODULE} matches no saved parameter groups by identifier keys"
    if gives_alike_groups_one_saved_group(module):
        return True, "parameter groups that differ only in max_lr take one saved group on load (the other's max_lr)"
    if refuses_a_changed_learning_rate(module):
        return True, (
            "a parameter group whose learning rate changed since the save (--lr, --min-lr) finds no saved "
            "group: the load stops"
        )
    return False, "each parameter group takes its own saved group, also with a changed learning rate"


def _keys_object(module):
    held = vars(module)[GLOBAL]
    if isinstance(held, IdentifierKeys):
        return held
    return _INSTALLED.setdefault(GLOBAL, IdentifierKeys(held))


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module, GLOBAL, _keys_object(module))
    patcher.replace(module.MegatronOptimizer, "_filter_and_reorder_param_groups", STATIC_FILTER)


class _ProbeDone(Exception):
    pass


class _RecordingKeys:
    """Stands in for the module's ``param_group_identifier_keys``: the release's keys, recording
    whether they were iterated."""

    def __init__(self, keys):
        self.keys, self.iterated = tuple(keys), False

    def __iter__(self):
        self.iterated = True
        return iter(self.keys)


def matches_saved_groups_by_identifier_keys(module) -> bool:
    """Does the release's ``DistributedOptimizer.load_state_dict`` (what :func:`distrib_load_state_dict`
    wraps) match the saved parameter groups by the module's ``param_group_identifier_keys`` (what the
    wrapper chooses)? It runs in a copy of the module's globals with recording keys, on a stand-in
    optimizer whose inner ``state_dict()`` (read after the saved groups are matched) stops it."""

    def stop():
        raise _ProbeDone

    held = vars(module).get(GLOBAL)
    keys = _RecordingKeys(tuple.__iter__(held) if isinstance(held, tuple) else ())
    stand_in = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False, use_custom_fsdp=False),
        optimizer=types.SimpleNamespace(state={0: {}}, state_dict=stop, param_groups=[]),
    )
    release = original(module.DistributedOptimizer, "load_state_dict")
    load = in_scope(release, module_scope(module, **{GLOBAL: keys}))
    try:
        load(stand_in, {"optimizer": {"param_groups": [_group([0], 1.0)]}})
    except Exception:  # _ProbeDone, or the release's own error on the stand-in: only the keys count
        pass
    return keys.iterated


def probe_distrib(module: types.ModuleType):
    cls = module.__dict__.get("DistributedOptimizer")
    if cls is None or "load_state_dict" not in cls.__dict__ or GLOBAL not in vars(module):
        return None, f"{DISTRIB_MODULE} matches no saved parameter groups by identifier keys"
    verdict, why = probe(sys.modules[MODULE])
    # Where optimizer.py has the bug, the distributed load must still match saved groups by the keys
    # the wrapper chooses; where it is fixed (a patched source no longer reads those keys), fixed.
    if verdict and not matches_saved_groups_by_identifier_keys(module):
        return None, f"DistributedOptimizer.load_state_dict does not match saved parameter groups by {GLOBAL}"
    return verdict, why


def apply_distrib(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module, GLOBAL, _keys_object(sys.modules[MODULE]), bound_from=(sys.modules[MODULE], GLOBAL))
    patcher.replace(module.DistributedOptimizer, "load_state_dict", distrib_load_state_dict)
