"""mimo-optimizer, the monkeypatch: ``MimoOptimizer.sharded_state_dict`` / ``load_state_dict`` and
``_get_replica_id`` replaced on 0.17/0.18 (save side, defects (a)-(e)), the two methods wrapped on 0.19
(defect (e) only: each module's common state, :mod:`.common_state`), ``dist_checkpointing.load``
wrapped on every affected release (load side, which asks :mod:`.old_layouts` what to request), the
probe and apply. What the fix prevents: the package docstring; how, in full: its doc.md. Imported only when the
target module is.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import types
import warnings

from ....engine.errors import MegatronPatchWarning
from ....engine.layers import layer
from ....engine.patching import Patcher, mark, original
from ....engine.probing import Group, in_scope, module_scope, module_scopes
from .. import ID, LOAD_MODULE, MODULE
from .common_state import _extract_common_state, _restore_common_state
from ....dcp_metadata import install as share_metadata_reads, shared_metadata
from .old_layouts import _mimo_sharded_leaves, align_mimo_optimizer_request

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
            suffix = f".{idx}" if idx else ""
            _as_objects(sub_sd, name, suffix, rid)
            # Last: what is still plain now is the module's common state (defect (e)).
            _extract_common_state(sub_sd, name, suffix, rid)
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
            _restore_common_state(sub_sd)
            _restore(sub_sd, inner, name)
        info.optimizer.load_state_dict(module_sd)


@mark(ID)
def get_replica_id(pg_collection):
    return replica_id(pg_collection)


# Where upstream already writes the per-module layout (0.19, or 0.17/0.18 source-patched by an
# earlier version of this fix) only defect (e) is left: wrap its methods instead of replacing them.


@layer(ID, MODULE, "sharded_state_dict", owner="MimoOptimizer")
def sharded_state_dict_keeping_common_state(
    below_us, self, model_sharded_state_dict, is_loading: bool = False, **kwargs
):
    out = below_us(self, model_sharded_state_dict, is_loading, **kwargs)
    for name, info in self.module_infos.items():
        if not (info.is_active and info.optimizer) or not isinstance(out.get(name), dict):
            continue
        rid = replica_id(info.pg_collection)
        for idx, (sub_sd, _inner) in enumerate(_sub_dicts(out[name], info.optimizer)):
            suffix = f".{idx}" if idx else ""
            _extract_common_state(sub_sd, name, suffix, rid)
            # Upstream has prefixed the module's keys already: prefix the new object alike.
            obj = sub_sd["_mimo_common_state" + suffix]
            obj.key = f"mimo.{name}." + obj.key
    return out


@layer(ID, MODULE, "load_state_dict", owner="MimoOptimizer")
def load_state_dict_keeping_common_state(below_us, self, state_dict):
    for name, info in self.module_infos.items():
        module_sd = state_dict.get(name) if isinstance(state_dict, dict) else None
        if info.is_active and info.optimizer and isinstance(module_sd, dict):
            for sub_sd, _inner in _sub_dicts(module_sd, info.optimizer):
                _restore_common_state(sub_sd)
    return below_us(self, state_dict)


# -- load side (what to request for which stored layout: old_layouts.py) ----------------------


@layer(ID, LOAD_MODULE, "load")
def load(below_us, *args, **kwargs):
    """``dist_checkpointing.load`` that also reads the MIMO optimizer layout of unfixed releases."""
    try:
        bound = inspect.signature(below_us).bind(*args, **kwargs)
    except TypeError:
        return below_us(*args, **kwargs)  # let the original raise its own error
    # One .metadata read for the decision and the load together (mcore_ckpt_fixes.dcp_metadata).
    with shared_metadata():
        request, finish = align_mimo_optimizer_request(
            bound.arguments["sharded_state_dict"], bound.arguments["checkpoint_dir"]
        )
        bound.arguments["sharded_state_dict"] = request
        result = below_us(*bound.args, **bound.kwargs)
    for text in finish(result[0] if isinstance(result, tuple) else result):
        # stacklevel 3: the caller's line, past @layer's frame.
        warnings.warn(f"mcore_ckpt_fixes: {ID}: {text}", MegatronPatchWarning, stacklevel=3)
    return result


# -- probe: run the real methods on inert stand-ins and look at what they produce ---------------


# What the stand-in inner optimizer returns as plain (common) state, found again by identity.
_PLAIN = type("_ProbePlainValue", (), {"__repr__": lambda self: "<probe plain value>"})()


def _carries(data, value):
    if data is value:
        return True
    if isinstance(data, dict):
        return any(_carries(v, value) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_carries(v, value) for v in data)
    return False


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
            # A plain value, as Float16Optimizer's ``optimizer.state.common_step``: common state.
            "common_step": _PLAIN,
        }

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def _release_methods(module):
    """The release's ``MimoOptimizer.sharded_state_dict`` and ``load_state_dict`` (not the fix's,
    once applied), reading the release's ``_get_replica_id`` from a copy of the module's globals
    (the live module is left as it is)."""
    cls = module.MimoOptimizer
    releases = {name: original(module, name) for name in ("_get_replica_id",) if name in module.__dict__}
    scope = module_scope(module, **releases)
    return tuple(in_scope(original(cls, name), scope) for name in ("sharded_state_dict", "load_state_dict"))


def _save_side_problems(module):
    """The defects (a)-(d) the real MimoOptimizer methods show on stand-in inner optimizers."""
    cls, info_cls = module.MimoOptimizer, module.ModuleOptimizerInfo
    ShardedBase, ShardedObject, _ = _megatron()
    inner = _InnerStandIn()
    pgs = types.SimpleNamespace(tp=Group(rank=1, size=2), pp=Group(rank=0, size=2), dp=Group(rank=0, size=2))
    infos = {
        "language": info_cls(optimizer=None, grid=None, pg_collection=None, is_active=False),
        "vision": info_cls(optimizer=inner, grid=None, pg_collection=pgs, is_active=True),
    }
    opt = cls.__new__(cls)  # no __init__: it reads an OptimizerConfig the probe does not need
    opt.module_infos = infos
    save, load = _release_methods(module)
    sd = save(opt, {}, is_loading=False)["vision"]
    objects = [v for v in _leaves(sd) if isinstance(v, ShardedBase)]
    problems = []
    if any(not o.key.startswith("mimo.vision.") for o in objects):
        problems.append("(d) inner keys are not prefixed by module")
    if "param_state_sharding_type" in sd:
        problems.append("(b) param_state_sharding_type stays in the rank-0 common state")
    groups = [o for o in objects if isinstance(o, ShardedObject) and o.key.endswith("param_groups")]
    if not groups or groups[0].replica_id[0] != 1:
        problems.append("(c) _get_replica_id ignores the TP rank")
    # (e): the plain value must travel in one of the module's own objects (common state is
    # written by global rank 0 only, which holds another module).
    saved_plain = any(_carries(o.data, _PLAIN) for o in objects if isinstance(o, ShardedObject))
    # (a): load a module sub-dict whose emptied ``optimizer`` dict did not come back, and (e) whose
    # plain value is absent from the common state (rank 0's): it must come back from the objects.
    loaded = {
        k: v.data if isinstance(v, ShardedObject) else v for k, v in sd.items() if k not in ("optimizer", "common_step")
    }
    try:
        load(opt, {"language": None, "vision": loaded})
    except KeyError:
        problems.append("(a) load raises KeyError when the module's 'optimizer' dict was not saved")
    restored = inner.loaded is not None and inner.loaded.get("common_step") is _PLAIN
    if not (saved_plain and (restored or inner.loaded is None)):
        problems.append(
            "(e) a module's plain optimizer state (e.g. torch Adam's common_step) stays in the common state "
            "that only global rank 0 writes"
        )
    return problems


class _RecordingLoad:
    """A load strategy that records the keys it is asked for and reads nothing."""

    def __init__(self):
        self.keys = []

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        self.keys = [item.key for _, item in _mimo_sharded_leaves(sharded_state_dict)]
        return {}


# The probe's checkpoint: a directory name that is never opened. The probe's copy of the load reads
# it with stand-ins that answer for that name from memory (and pass any other directory to
# Megatron's own).
_PROBE_DIR = os.path.join(os.sep, "nonexistent", "mcore-ckpt-fixes-probe")
_STRATEGIES = "megatron.core.dist_checkpointing.strategies.torch"


class _ProbeReader:
    """What a DCP reader's ``read_metadata`` tells of the probe's checkpoint: the names it holds."""

    def __init__(self, names):
        self.names = names

    def read_metadata(self):
        return types.SimpleNamespace(state_dict_metadata=dict.fromkeys(self.names))


def _for_probe_dir(real, answer):
    def stand_in(checkpoint_dir, *args, **kwargs):
        if os.fspath(checkpoint_dir) == _PROBE_DIR:
            return answer()
        return real(checkpoint_dir, *args, **kwargs)

    return stand_in


def _probe_checkpoint(names):
    """(module, name, stand-in) for what ``dist_checkpointing.load`` reads a checkpoint with: the
    existence check, the common state (0.17/0.18: ``load_common``; 0.19: ``load_common_state_dict``,
    empty, as in a checkpoint without plain values) and the DCP metadata reader (``names``)."""
    serialization, strategies = importlib.import_module(LOAD_MODULE), importlib.import_module(_STRATEGIES)
    answers = (
        (serialization, "verify_checkpoint", lambda: None),
        (serialization, "load_common", dict),
        (serialization, "load_common_state_dict", dict),
        (strategies, "_get_filesystem_reader", lambda: _ProbeReader(names)),
        # A source carrying this fix's diff reads the names through its own helper.
        (serialization, "_mimo_checkpoint_names", lambda: set(names)),
    )
    return [(m, n, _for_probe_dir(m.__dict__[n], answer)) for m, n, answer in answers if n in m.__dict__]


_READS_OLD = {}  # dist_checkpointing.load -> the verdict on it (probe and apply ask alike)


def _load_reads_old_layout():
    """Does the real ``dist_checkpointing.load`` ask for the unprefixed name when the checkpoint
    only has that, and leave out a module's common-state object the checkpoint does not have? A
    checkpoint held in memory (its names, an empty common state: :func:`_probe_checkpoint`) and a
    recording strategy stand in for the files and the reads: nothing is written or read."""
    serialization = importlib.import_module(LOAD_MODULE)
    load = serialization.load
    if load in _READS_OLD:
        return _READS_OLD[load]
    _, ShardedObject, _ = _megatron()
    old = ShardedObject("optimizer.distributed.x", None, (1,), (0,))
    current = ShardedObject("mimo.language.y", None, (1,), (0,))
    # vision: stored under the unprefixed 0.17/0.18 name; language: the current names, but without
    # the per-module common-state object (what every release writes unpatched).
    request = {
        "vision": {"x": ShardedObject("mimo.vision." + old.key, None, (1,), (0,))},
        "language": {
            "y": current,
            "_mimo_common_state": ShardedObject("mimo.language.optimizer.mimo.language.common_state", [], (1,), (0,)),
        },
    }
    recorder = _RecordingLoad()
    stand_ins = _probe_checkpoint({old.unique_key, current.unique_key})
    # The release's load in linked copies of the modules' globals with the stand-ins: the live
    # modules are left as they are.
    overrides = {serialization: {}}
    for m, n, stand_in in stand_ins:
        overrides.setdefault(m, {})[n] = stand_in
    release_load = original(serialization, "load")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixed load warns about the old layout: expected
        in_scope(release_load, module_scopes(overrides)[serialization])(
            request, _PROBE_DIR, sharded_strategy=recorder, validate_access_integrity=False
        )
    verdict = _READS_OLD[load] = sorted(recorder.keys) == sorted([old.key, current.key])
    return verdict


def probe(module: types.ModuleType):
    if getattr(module, "MimoOptimizer", None) is None or getattr(module, "ModuleOptimizerInfo", None) is None:
        return None, f"{MODULE} has no MimoOptimizer"
    problems = _save_side_problems(module)
    reads_old = _load_reads_old_layout()
    load_gap = (
        "dist_checkpointing.load cannot read the MIMO optimizer layouts unfixed releases wrote "
        "(0.17/0.18: keys without 'mimo.<module>.', sharding type in the rank-0 common state; "
        "0.17-0.19: no per-module common state)"
    )
    if problems:
        tail = "" if reads_old else f"; {load_gap}"
        return True, "MimoOptimizer checkpointing with non-colocated modules: " + "; ".join(problems) + tail
    if not reads_old:
        return True, f"load side only: {load_gap}: the fix reads them, with a MegatronPatchWarning"
    return False, (
        "MimoOptimizer keeps each module's optimizer state, common state, sharding type and keys apart, "
        "and old checkpoints load"
    )


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
    problems = _save_side_problems(module)
    if any(not p.startswith("(e)") for p in problems):  # 0.17/0.18: write the whole layout ourselves
        patcher.replace(module.MimoOptimizer, "sharded_state_dict", sharded_state_dict)
        patcher.replace(module.MimoOptimizer, "load_state_dict", load_state_dict)
        if hasattr(module, "_get_replica_id"):
            patcher.replace_function(module, "_get_replica_id", get_replica_id)
    elif problems:  # 0.19: upstream writes the per-module layout; add each module's common state
        patcher.replace(module.MimoOptimizer, "sharded_state_dict", sharded_state_dict_keeping_common_state)
        patcher.replace(module.MimoOptimizer, "load_state_dict", load_state_dict_keeping_common_state)
    if not _load_reads_old_layout():
        # replace_function: the package's ``dist_checkpointing.load`` (what megatron.training and
        # user code call) is the same function, bound by ``from .serialization import load``.
        patcher.replace_function(importlib.import_module(LOAD_MODULE), "load", load)
        # Its decision reads the checkpoint's metadata: shared with the load's own read.
        share_metadata_reads(patcher)
