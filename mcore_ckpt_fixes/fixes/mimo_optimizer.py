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

Reading what unfixed releases wrote (0.17.x-0.19.x): in the configurations an unpatched 0.17/0.18
can save (one module with an optimizer, e.g. a frozen encoder) its MIMO optimizer keys carry no
``mimo.<module>.`` prefix and, on 0.17, the sharding type sits in the common state that only global
rank 0 writes (so a module on another rank has none). The keys a load asks for are fixed in
``sharded_state_dict`` before anything opens the checkpoint, so this half wraps
``dist_checkpointing.load``: when the request holds ``mimo.<module>.`` keys, it reads the checkpoint's
metadata (names only); for a module whose state is stored only under the unprefixed names it asks for
those, fills a sharding type the checkpoint does not have with the one the load requested (its keys
are that type's keys, or the load would fail on them), and emits one ``MegatronPatchWarning`` naming
the old layout. Upstream 0.19 writes the new layout but reads only it: there this load side is all
the fix contributes, and ``status`` says so. The probe runs the real ``dist_checkpointing.load`` on
a throw-away two-file checkpoint written by ``torch.distributed.checkpoint`` (no process group) and
a recording load strategy, so a source-patched Megatron is recognised as fixed.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import types
import warnings

from ..engine.errors import MegatronPatchWarning
from ..engine.fix import Fix, Target
from ..engine.patching import Patcher, mark, original

ID = "mimo-optimizer"
MODULE = "megatron.core.models.mimo.optimizer"
LOAD_MODULE = "megatron.core.dist_checkpointing.serialization"

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


# -- replacement ---------------------------------------------------------------------------------
# (tools/patchgen/mimo_optimizer.py copies the code from here to the end marker into
# megatron/core/dist_checkpointing/serialization.py for patches/mimo-optimizer/: keep it
# self-contained, imports inside the functions.)


def _mimo_sharded_leaves(tree):
    """(path, item) for every ShardedBase leaf of a nested dict/list state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    stack = [((), tree)]  # iterative: every load walks its whole request once
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in enumerate(node))
        elif isinstance(node, ShardedBase):
            yield path, node


def _mimo_stored_name(item):
    """The name torch_dist stores an item under (a ShardedObject carries its shard in the name)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return item.unique_key if isinstance(item, ShardedObject) else item.key


def _mimo_checkpoint_names(checkpoint_dir):
    """Every item name in a torch_dist checkpoint's metadata (the tensors are not read)."""
    try:
        from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader

        reader = _get_filesystem_reader(checkpoint_dir)
    except ImportError:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(str(checkpoint_dir))
    return set(reader.read_metadata().state_dict_metadata)


def _mimo_set(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _mimo_copy_containers(tree):
    if isinstance(tree, dict):
        return {k: _mimo_copy_containers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_mimo_copy_containers(v) for v in tree]
    return tree


# The per-module objects MimoOptimizer adds (0.17: param groups and grad scaler; 0.18+: the
# sharding type too): position in the module's sub-dict -> the plain value they stand for.
_MIMO_PLAIN_FIELDS = {
    "_mimo_param_groups": ("optimizer", "param_groups"),
    "_mimo_param_state_sharding_type": ("param_state_sharding_type",),
    "_mimo_grad_scaler": ("grad_scaler",),
}


def align_mimo_optimizer_request(sharded_state_dict, checkpoint_dir):
    """(request, finish): what ``dist_checkpointing.load`` should ask for, and ``finish(loaded)``,
    which completes the loaded state dict and returns the warning to give (or None).

    A MIMO optimizer module whose keys (``mimo.<module>.<key>``) are absent from the checkpoint
    while the unprefixed ``<key>`` names are there was saved by an unfixed Megatron-Core
    0.17/0.18: ask for the unprefixed names. What that layout did not store for a module (0.17
    keeps the sharding type in the common state, which only global rank 0 writes) is filled with
    the value the load requested: the module's optimizer keys are that sharding type's keys, or
    the load would already fail on them. The caller's dict is left as it was built.
    """
    import dataclasses
    import re

    modules = {}
    mimo_key = re.compile(r"mimo\.([^.]+)\.")
    for path, item in _mimo_sharded_leaves(sharded_state_dict):
        match = mimo_key.match(item.key) if item.key.startswith("mimo.") else None
        if match:
            modules.setdefault(match.group(1), []).append((path, item))
    if not modules:
        return sharded_state_dict, lambda loaded: None
    names = _mimo_checkpoint_names(checkpoint_dir)
    old = {}
    for module, items in modules.items():
        prefix = f"mimo.{module}."
        if any(name.startswith(prefix) for name in names):
            continue  # the current layout: nothing to do for this module
        renamed = [(path, dataclasses.replace(item, key=item.key[len(prefix):])) for path, item in items]
        if any(_mimo_stored_name(item) in names for _, item in renamed):
            old[module] = renamed
    if not old:
        return sharded_state_dict, lambda loaded: None  # unknown layout: let the load report it
    request = _mimo_copy_containers(sharded_state_dict)
    missing = []  # (path, module, value requested) for objects the old layout did not store
    for module, renamed in old.items():
        for path, item in renamed:
            field = str(path[-1]).split(".")[0]
            if field in _MIMO_PLAIN_FIELDS and _mimo_stored_name(item) not in names:
                _mimo_set(request, path, None)
                missing.append((path, module, item.data))
            else:
                _mimo_set(request, path, item)
    for path, _, _ in missing:
        parent = request
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]

    def finish(loaded):
        assumed = []
        for path, module, value in missing:
            parent = loaded
            for key in path[:-1]:
                parent = parent.setdefault(key, {}) if isinstance(parent, dict) else parent[key]
            plain = _MIMO_PLAIN_FIELDS[str(path[-1]).split(".")[0]]
            holder = parent
            for key in plain[:-1]:
                holder = holder.get(key, {}) if isinstance(holder, dict) else {}
            if isinstance(holder, dict) and plain[-1] in holder:
                continue  # the common state had it (the module on global rank 0)
            parent[path[-1]] = value
            assumed.append(f"{module}.{plain[-1]} = {value!r}")
        text = (
            f"{checkpoint_dir} holds the MIMO optimizer state of module(s) {', '.join(sorted(old))} in the "
            f"layout of an unfixed Megatron-Core 0.17/0.18 (keys without the 'mimo.<module>.' prefix); "
            f"read from those keys"
        )
        if assumed:
            text += (
                "; not stored there (0.17 keeps it in the common state, which only global rank 0 "
                "writes), so taken from this load's request, whose keys the checkpoint has: "
                + ", ".join(assumed)
            )
        return text + "; the next save writes the current layout"

    return request, finish


# -- end of replacement ---------------------------------------------------------------------------


@mark(ID)
def load(*args, **kwargs):
    """``dist_checkpointing.load`` that also reads the MIMO optimizer layout of unfixed releases."""
    func = original(LOAD_MODULE, "load")
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return func(*args, **kwargs)  # let the original raise its own error
    request, finish = align_mimo_optimizer_request(
        bound.arguments["sharded_state_dict"], bound.arguments["checkpoint_dir"]
    )
    bound.arguments["sharded_state_dict"] = request
    result = func(*bound.args, **bound.kwargs)
    text = finish(result[0] if isinstance(result, tuple) else result)
    if text is not None:
        warnings.warn(f"mcore_ckpt_fixes: {ID}: {text}", MegatronPatchWarning, stacklevel=2)
    return result


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


def _save_side_problems(module):
    """The defects (a)-(d) the real MimoOptimizer methods show on stand-in inner optimizers."""
    cls, info_cls = module.MimoOptimizer, module.ModuleOptimizerInfo
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
    return problems


class _RecordingLoad:
    """A load strategy that records the keys it is asked for and reads nothing."""

    def __init__(self):
        self.keys = []

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        self.keys = [item.key for _, item in _mimo_sharded_leaves(sharded_state_dict)]
        return {}


def _load_reads_old_layout():
    """Does the real ``dist_checkpointing.load`` ask for the unprefixed name when the checkpoint
    only has that? A throw-away checkpoint (metadata, config and common state; written by torch
    DCP without a process group) and a recording strategy stand in for the files and the reads."""
    import json
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp

    serialization = importlib.import_module(LOAD_MODULE)
    _, ShardedObject, _ = _megatron()
    with tempfile.TemporaryDirectory(prefix="mcore-ckpt-fixes-probe-") as ckpt:
        old = ShardedObject("optimizer.distributed.x", None, (1,), (0,))
        dcp.save({old.unique_key: torch.zeros(1)}, storage_writer=dcp.FileSystemWriter(ckpt), no_dist=True)
        with open(os.path.join(ckpt, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
        torch.save({}, os.path.join(ckpt, "common.pt"))
        request = {"vision": {"x": ShardedObject("mimo.vision." + old.key, None, (1,), (0,))}}
        recorder = _RecordingLoad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fixed load warns about the old layout: expected
            serialization.load(request, ckpt, sharded_strategy=recorder, validate_access_integrity=False)
    return recorder.keys == [old.key]


def probe(module: types.ModuleType):
    if getattr(module, "MimoOptimizer", None) is None or getattr(module, "ModuleOptimizerInfo", None) is None:
        return None, f"{MODULE} has no MimoOptimizer"
    problems = _save_side_problems(module)
    reads_old = _load_reads_old_layout()
    load_gap = (
        "dist_checkpointing.load cannot read the MIMO optimizer layout unfixed 0.17/0.18 wrote "
        "(keys without 'mimo.<module>.', sharding type in the rank-0 common state)"
    )
    if problems:
        tail = "" if reads_old else f"; {load_gap}"
        return True, "MimoOptimizer checkpointing with non-colocated modules: " + "; ".join(problems) + tail
    if not reads_old:
        return True, (
            f"load side only: MimoOptimizer already saves every module under its own keys; {load_gap}: "
            f"the fix reads it, with a MegatronPatchWarning"
        )
    return False, "MimoOptimizer keeps each module's optimizer state, sharding type and keys apart, and old checkpoints load"


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
    if _save_side_problems(module):  # 0.17/0.18; 0.19 saves the fixed layout itself
        patcher.replace(module.MimoOptimizer, "sharded_state_dict", sharded_state_dict)
        patcher.replace(module.MimoOptimizer, "load_state_dict", load_state_dict)
        if hasattr(module, "_get_replica_id"):
            patcher.replace_function(module, "_get_replica_id", get_replica_id)
    if not _load_reads_old_layout():
        # replace_function: the package's ``dist_checkpointing.load`` (what megatron.training and
        # user code call) is the same function, bound by ``from .serialization import load``.
        patcher.replace_function(importlib.import_module(LOAD_MODULE), "load", load)


FIX = Fix(
    id=ID,
    summary=(
        "MimoOptimizer checkpoints with non-colocated modules keep every module's state, sharding type "
        "and keys, and the layout unfixed 0.17/0.18 wrote still loads"
    ),
    affected=">=0.17.0,<=0.19.2",
    upstream=(
        "fixed upstream in Megatron-Core 0.18.0 (a, b, c) and 0.19.0 (d): megatron/core/models/mimo/optimizer.py",
        "reading the 0.17/0.18 layout: not upstream as of 0.19.2 (0.19 reads only its own layout)",
    ),
    targets=(Target(MODULE, probe, apply),),
)
