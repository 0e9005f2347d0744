"""param-group-identity's monkeypatch on ``megatron.core.optimizer.optimizer``: wrappers of
``ChainedOptimizer.load_state_dict`` and ``MegatronOptimizer._filter_and_reorder_param_groups``, the
probe and apply. Why: the package's docstring. Imported only when the target module is.

Both wrappers hand the call to the release's own method with ``param_group_identifier_keys`` (a
module global of ``optimizer`` and of ``distrib_optimizer``, read by their matching code at call
time) set to the keys :func:`_param_group_identifier_keys_for` chose, for the duration of the call.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

from ....engine.errors import MegatronPatchWarning
from ....engine.patching import MARK, Patcher, is_replacement, original
from .. import ID, MODULE

DISTRIB_MODULE = "megatron.core.optimizer.distrib_optimizer"
GLOBAL = "param_group_identifier_keys"


# The release's param_group_identifier_keys, taken at apply (outside any load's swap).
_RELEASE: dict = {}


def _release_keys():
    return _RELEASE.get(GLOBAL) or tuple(vars(sys.modules[MODULE]).get(GLOBAL, ()))


# The release's tuple, whatever the module holds during a swap (read by the helper below, whose text
# the source diff carries: in the release's module this name is its own global).
class _ReleaseKeys:
    def __iter__(self):
        return iter(_release_keys())


param_group_identifier_keys = _ReleaseKeys()


# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/optimizer.py, below param_group_identifier_keys.

# What a parameter-group override may set (ParamGroupOverride): two groups alike by
# param_group_identifier_keys may still differ in these.
_PARAM_GROUP_OVERRIDE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd", "optimizer")


def _param_group_identifier_keys_for(current_groups, saved_groups):
    """The keys that match current parameter groups to saved ones: param_group_identifier_keys, and
    where those leave two groups alike (a group with its own max_lr would take another group's
    saved one), also the override keys every group carries, if then every current group has
    exactly one saved group. Otherwise (an override changed since the save) the first ones."""
    base = tuple(param_group_identifier_keys)

    def identities(groups, keys):
        return [tuple(g[k] if k in g else g.get(f"pre_{k}") for k in keys) for g in groups]

    def distinct(ids):
        return len(set(ids)) == len(ids)

    if distinct(identities(current_groups, base)) and distinct(identities(saved_groups, base)):
        return base
    every_group = list(current_groups) + list(saved_groups)
    extra = tuple(k for k in _PARAM_GROUP_OVERRIDE_KEYS if k not in base and all(k in g for g in every_group))
    keys = base + extra
    current, saved = identities(current_groups, keys), identities(saved_groups, keys)
    if distinct(current) and distinct(saved) and set(current) <= set(saved):
        return keys
    return base


# -- end of replacement ---


@contextlib.contextmanager
def _identifier_keys(keys):
    """``param_group_identifier_keys`` is ``keys`` in the modules that match groups, in the block."""
    held = []
    for name in (MODULE, DISTRIB_MODULE):
        module = sys.modules.get(name)
        if module is not None and GLOBAL in vars(module):
            held.append((module, vars(module)[GLOBAL]))
            setattr(module, GLOBAL, tuple(keys))
    try:
        yield
    finally:
        for module, value in reversed(held):
            setattr(module, GLOBAL, value)


def _warn_if_still_alike(current_groups, keys):
    base = tuple(_release_keys())
    ids = [tuple(g.get(k, g.get(f"pre_{k}")) for k in base) for g in current_groups]
    if tuple(keys) == base and len(set(ids)) != len(ids):
        warnings.warn(
            f"mcore_ckpt_fixes: {ID}: parameter groups alike by {base} differ in their overrides and do not "
            "match the checkpoint's (an override changed since the save): they resume with one saved "
            "group's max_lr/min_lr, as Megatron-Core before 0.19 does",
            MegatronPatchWarning,
            stacklevel=3,
        )


def _keys_for(pairs):
    """One set of keys for every (current groups, saved groups) pair of a load, or the release's."""
    chosen = {_param_group_identifier_keys_for(current, saved) for current, saved in pairs}
    keys = chosen.pop() if len(chosen) == 1 else tuple(_release_keys())
    for current, _ in pairs:
        _warn_if_still_alike(current, keys)
    return keys


def filter_and_reorder_param_groups(current_groups, state_dict_groups):
    """``MegatronOptimizer._filter_and_reorder_param_groups`` (a staticmethod) with the keys that
    tell the groups apart."""
    release = original(sys.modules[MODULE].MegatronOptimizer, "_filter_and_reorder_param_groups")
    with _identifier_keys(_keys_for([(current_groups, state_dict_groups)])):
        return release(current_groups, state_dict_groups)


def _pairs(self, state_dict):
    """(current groups, saved groups) per chained optimizer, or None for a state dict of another shape."""
    subs = self.chained_optimizers
    if len(subs) == 1:
        states = [state_dict]
    elif isinstance(state_dict, dict):
        states = [v for _, v in sorted(state_dict.items())]
    elif isinstance(state_dict, (list, tuple)):
        states = list(state_dict)
    else:
        return None
    out = []
    for sub, state in zip(subs, states):
        inner = state.get("optimizer", state.get("optimizer_state_dict")) if isinstance(state, dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        current = getattr(getattr(sub, "optimizer", None), "param_groups", None)
        if groups is None or current is None:
            return None
        out.append((current, groups))
    return out


def chained_load_state_dict(self, state_dict):
    """``ChainedOptimizer.load_state_dict`` with the keys that tell every sub-optimizer's groups apart."""
    release = original(sys.modules[MODULE].ChainedOptimizer, "load_state_dict")
    pairs = _pairs(self, state_dict)
    if not pairs:
        return release(self, state_dict)
    with _identifier_keys(_keys_for(pairs)):
        return release(self, state_dict)


def chained_sharded_state_dict(self, *args, **kwargs):
    """``ChainedOptimizer.sharded_state_dict``: a load request (``is_loading``) makes each
    ``DistributedOptimizer`` load its own state into itself first (``load_state_dict(state_dict())``),
    which matches its groups to themselves: with the keys that tell them apart."""
    release = original(sys.modules[MODULE].ChainedOptimizer, "sharded_state_dict")
    groups = [getattr(getattr(sub, "optimizer", None), "param_groups", None) for sub in self.chained_optimizers]
    if any(g is None for g in groups):
        return release(self, *args, **kwargs)
    with _identifier_keys(_keys_for([(g, g) for g in groups])):
        return release(self, *args, **kwargs)


setattr(filter_and_reorder_param_groups, MARK, ID)
setattr(chained_load_state_dict, MARK, ID)
setattr(chained_sharded_state_dict, MARK, ID)
STATIC_FILTER = staticmethod(filter_and_reorder_param_groups)
setattr(STATIC_FILTER, MARK, ID)


# -- probe: the release's own matching on two groups that differ only in max_lr ---------------------


def _release_filter(cls):
    fn = cls.__dict__["_filter_and_reorder_param_groups"]
    fn = original(cls, "_filter_and_reorder_param_groups") if is_replacement(fn) else fn
    return fn.__func__ if isinstance(fn, staticmethod) else fn


def gives_alike_groups_one_saved_group(module) -> bool:
    def group(params, max_lr):
        return {"params": params, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                "is_decoupled_lr": False, "max_lr": max_lr, "min_lr": 0.0}  # fmt: skip

    current = [group([0], 1.0), group([1], 3.0)]
    saved = [group([0], 1.0), group([1], 3.0)]
    out = _release_filter(module.MegatronOptimizer)(current, saved)
    return [g["max_lr"] for g in out] != [1.0, 3.0]


def probe(module: types.ModuleType):
    cls = module.__dict__.get("MegatronOptimizer")
    if cls is None or "_filter_and_reorder_param_groups" not in cls.__dict__ or GLOBAL not in vars(module):
        return None, f"{MODULE} matches no saved parameter groups by identifier keys"
    if not gives_alike_groups_one_saved_group(module):
        return False, "parameter groups that differ only in max_lr each take their own saved group"
    return True, "parameter groups that differ only in max_lr take one saved group on load (the other's max_lr)"


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    _RELEASE[GLOBAL] = tuple(vars(module)[GLOBAL])
    patcher.replace(module.MegatronOptimizer, "_filter_and_reorder_param_groups", STATIC_FILTER)
    if "ChainedOptimizer" in vars(module):
        patcher.replace(module.ChainedOptimizer, "load_state_dict", chained_load_state_dict)
        patcher.replace(module.ChainedOptimizer, "sharded_state_dict", chained_sharded_state_dict)
