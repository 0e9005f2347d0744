"""mimo-optimizer: ``MimoOptimizer`` checkpoints with non-colocated modules save and load every module.

Affected: Megatron-Core 0.17.x (four defects) and 0.18.x (one); ``megatron.core.models.mimo``
appeared in 0.17.0, so 0.16 is not-applicable. Upstream: NVIDIA/Megatron-LM's MIMO optimizer
checkpointing changes that shipped in 0.18.0 (``setdefault('optimizer')`` on load,
``param_state_sharding_type`` as a ShardedObject, TP rank in ``_get_replica_id``) and in 0.19.0
(``add_prefix_for_sharding(module_sd, 'mimo.<module>.')``).

Failures prevented, with the modules on disjoint ranks (rank 0 the language model, rank 1 the
vision encoder), as ``MimoOptimizer`` is built for heterogeneous parallelism:

(a) 0.17: ``dist_checkpointing`` keeps plain (non-sharded) values in the common state that only
    global rank 0 writes. A module not active on rank 0 loses its ``optimizer`` sub-dict, and
    ``MimoOptimizer.load_state_dict`` raises ``KeyError: 'optimizer'``.
(b) 0.17: ``param_state_sharding_type`` is plain too, so the other modules never get theirs back
    (``DistributedOptimizer.load_state_dict`` asserts it is there).
(c) 0.17: ``_get_replica_id`` returns ``(0, pp, dp)``: every TP rank claims to be the main replica
    of the module's param groups (``Duplicate ShardedObject keys ... param_groups``).
(d) 0.17 and 0.18: the inner ``DistributedOptimizer``s of two modules name their ShardedObjects and
    ShardedTensors alike (``optimizer.distributed.dp_group_idx_0...``: the index is the rank in the
    module's own model-parallel group), so the save fails with ``Duplicate ShardedObject keys``.

How: ``MimoOptimizer.sharded_state_dict`` and ``load_state_dict`` are replaced by versions that
write exactly what 0.19 writes (so a checkpoint saved by a patched 0.17/0.18 loads on unpatched
0.19): param groups, sharding type and grad scaler as per-module ShardedObjects whose replica id
is ``(tp, pp, dp)``, the emptied ``optimizer`` sub-dict dropped, and every inner key prefixed
with ``mimo.<module>.``. On load, the missing ``optimizer`` sub-dict is recreated.

Not done: reading what an unpatched 0.17/0.18 wrote in the configurations it can save (one module
with an optimizer, or non-distributed inner optimizers). Those keys carry no ``mimo.<module>.``
prefix and the sharding type sits in ``common.pt``; the keys a load asks for are fixed in
``sharded_state_dict`` before ``dist_checkpointing.load`` opens the checkpoint, so reading them
needs a hook at the load call, not here. Such a load fails loudly (missing keys), never silently.
"""

from __future__ import annotations

import copy
import types

from ..engine.fix import Fix, Target
from ..engine.patching import Patcher, mark

ID = "mimo-optimizer"
MODULE = "megatron.core.models.mimo.optimizer"

# Where each plain value travels in the 0.18+/0.19 layout: sub-dict key -> ShardedObject name.
_GROUPS, _TYPE, _SCALER = "_mimo_param_groups", "_mimo_param_state_sharding_type", "_mimo_grad_scaler"


def _megatron():
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject

    return ShardedBase, ShardedObject, dict_list_map_inplace


# -- helpers (ours, release-independent) ------------------------------------------------------


def replica_id(pg_collection):
    """``(tp, pp, dp)`` rank: exactly one rank of a module (all three 0) writes its objects."""
    for name in ("tp", "pp", "dp"):
        if pg_collection is None or getattr(pg_collection, name, None) is None:
            raise AssertionError(f"pg_collection.{name} must be set for MIMO optimizer checkpoint deduplication")
    return (pg_collection.tp.rank(), pg_collection.pp.rank(), pg_collection.dp.rank())


def _sub_dicts(module_sd, optimizer):
    """(sub-dict, inner optimizer) pairs: one per chained optimizer when there are several."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None and len(chained) > 1:
        return [(module_sd[i], inner) for i, inner in enumerate(chained)]
    return [(module_sd, optimizer)]


def _as_objects(sub_sd, module_name, suffix, rid):
    """Move the plain per-module values into ShardedObjects (saved by their own module's ranks)."""
    _, ShardedObject, _ = _megatron()

    def obj(what, value):
        return ShardedObject(f"optimizer.mimo.{module_name}{suffix}.{what}", value, (1,), (0,), replica_id=rid)

    opt_sub = sub_sd.get("optimizer")
    if isinstance(opt_sub, dict) and "param_groups" in opt_sub:
        groups = copy.deepcopy(opt_sub.pop("param_groups"))
        for g in groups:
            g["params"] = []  # the load side puts the current optimizer's ids back
        sub_sd[_GROUPS + suffix] = obj("param_groups", groups)
        if not opt_sub:
            # An empty dict would be common state, written by global rank 0 only.
            del sub_sd["optimizer"]
    if "param_state_sharding_type" in sub_sd:
        sub_sd[_TYPE + suffix] = obj("param_state_sharding_type", sub_sd.pop("param_state_sharding_type"))
    if sub_sd.get("grad_scaler") is not None:
        sub_sd[_SCALER + suffix] = obj("grad_scaler", sub_sd.pop("grad_scaler"))


def _prefix(module_sd, prefix):
    ShardedBase, _, dict_list_map_inplace = _megatron()

    def add(x):
        if isinstance(x, ShardedBase):
            x.key = prefix + x.key
        return x

    dict_list_map_inplace(add, module_sd)


def _pop_prefixed(sub_sd, stem):
    for k in list(sub_sd):
        if isinstance(k, str) and k.startswith(stem):
            return True, sub_sd.pop(k)
    return False, None


def _restore(sub_sd, inner, module_name):
    found, groups = _pop_prefixed(sub_sd, _GROUPS)
    if found:
        current = inner.optimizer.state_dict()["param_groups"]
        if len(groups) != len(current):
            raise ValueError(
                f"MIMO optimizer {module_name!r}: checkpoint has {len(groups)} param groups, "
                f"the current optimizer {len(current)}"
            )
        for g, cur in zip(groups, current):
            g["params"] = cur["params"]
        # The emptied ``optimizer`` sub-dict is not saved (see _as_objects): recreate it.
        sub_sd.setdefault("optimizer", {})["param_groups"] = groups
    found, value = _pop_prefixed(sub_sd, _TYPE)
    if found:
        sub_sd["param_state_sharding_type"] = value
    found, value = _pop_prefixed(sub_sd, _SCALER)
    if found:
        sub_sd["grad_scaler"] = value


# -- replacements (plain module-level functions: picklable by reference) ----------------------


@mark(ID)
def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
    out = {}
    for name, info in self.module_infos.items():
        if not (info.is_active and info.optimizer):
            out[name] = {}
            continue
        module_sd = info.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        rid = replica_id(info.pg_collection)
        for idx, (sub_sd, _inner) in enumerate(_sub_dicts(module_sd, info.optimizer)):
            _as_objects(sub_sd, name, f".{idx}" if idx else "", rid)
        # Inner keys are named by the module's own parallel layout (dp_group_idx_0 in every
        # module): the module name keeps two modules' objects apart.
        _prefix(module_sd, f"mimo.{name}.")
        out[name] = module_sd
    return out


@mark(ID)
def load_state_dict(self, state_dict):
    for name, info in self.module_infos.items():
        if not (info.is_active and info.optimizer):
            continue
        module_sd = state_dict.get(name)
        if module_sd is None:
            continue
        for sub_sd, inner in _sub_dicts(module_sd, info.optimizer):
            _restore(sub_sd, inner, name)
        info.optimizer.load_state_dict(module_sd)


@mark(ID)
def get_replica_id(pg_collection):
    return replica_id(pg_collection)


# -- probe: run the real methods on inert stand-ins and look at what they produce ---------------


class _Group:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank

    def size(self):
        return 2


class _InnerStandIn:
    """What ``MimoOptimizer`` asks of an inner optimizer during checkpointing, nothing more."""

    def __init__(self):
        self.loaded = None
        self.optimizer = types.SimpleNamespace(state_dict=lambda: {"param_groups": [{"params": [7]}]})

    def sharded_state_dict(self, model_sd, is_loading=False, **kwargs):
        _, ShardedObject, _ = _megatron()
        return {
            "optimizer": {"param_groups": [{"lr": 0.5, "params": [7]}]},
            "param_state": {"x": ShardedObject("optimizer.distributed.dp_group_idx_0.x", 1, (1,), (0,))},
            "param_state_sharding_type": "dp_reshardable",
        }

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def probe(module: types.ModuleType):
    cls = getattr(module, "MimoOptimizer", None)
    info_cls = getattr(module, "ModuleOptimizerInfo", None)
    if cls is None or info_cls is None:
        return None, f"{MODULE} has no MimoOptimizer"
    ShardedBase, ShardedObject, _ = _megatron()
    inner = _InnerStandIn()
    pgs = types.SimpleNamespace(tp=_Group(1), pp=_Group(0), dp=_Group(0))
    infos = {
        "language": info_cls(optimizer=None, grid=None, pg_collection=None, is_active=False),
        "vision": info_cls(optimizer=inner, grid=None, pg_collection=pgs, is_active=True),
    }
    opt = cls.__new__(cls)  # no __init__: it reads an OptimizerConfig the probe does not need
    opt.module_infos = infos
    sd = cls.sharded_state_dict(opt, {}, is_loading=False)["vision"]
    objects = [v for v in _leaves(sd) if isinstance(v, ShardedBase)]
    problems = []
    if any(not o.key.startswith("mimo.vision.") for o in objects):
        problems.append("(d) inner keys are not prefixed by module")
    if "param_state_sharding_type" in sd:
        problems.append("(b) param_state_sharding_type stays in the rank-0 common state")
    groups = [o for o in objects if isinstance(o, ShardedObject) and o.key.endswith("param_groups")]
    if not groups or groups[0].replica_id[0] != 1:
        problems.append("(c) _get_replica_id ignores the TP rank")
    # (a): load a module sub-dict whose emptied ``optimizer`` dict did not come back.
    loaded = {k: v.data if isinstance(v, ShardedObject) else v for k, v in sd.items() if k != "optimizer"}
    try:
        cls.load_state_dict(opt, {"language": None, "vision": loaded})
    except KeyError:
        problems.append("(a) load raises KeyError when the module's 'optimizer' dict was not saved")
    if problems:
        return True, "MimoOptimizer checkpointing with non-colocated modules: " + "; ".join(problems)
    return False, "MimoOptimizer keeps each module's optimizer state, sharding type and keys apart"


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.MimoOptimizer, "sharded_state_dict", sharded_state_dict)
    patcher.replace(module.MimoOptimizer, "load_state_dict", load_state_dict)
    if hasattr(module, "_get_replica_id"):
        patcher.replace_function(module, "_get_replica_id", get_replica_id)


FIX = Fix(
    id=ID,
    summary="MimoOptimizer checkpoints with non-colocated modules keep every module's state, sharding type and keys",
    affected=">=0.17.0,<0.19.0",
    upstream=(
        "fixed upstream in Megatron-Core 0.18.0 (a, b, c) and 0.19.0 (d): megatron/core/models/mimo/optimizer.py",
    ),
    targets=(Target(MODULE, probe, apply),),
)
