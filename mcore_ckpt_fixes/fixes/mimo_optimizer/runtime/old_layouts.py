"""mimo-optimizer, load side: reading the MIMO optimizer layout unfixed Megatron-Core 0.17/0.18 wrote.

In the configurations an unpatched 0.17/0.18 can save (one module with an optimizer, e.g. a frozen
encoder) its MIMO optimizer keys carry no ``mimo.<module>.`` prefix and, on 0.17, the sharding type
sits in the common state that only global rank 0 writes (so a module on another rank has none).
:func:`align_mimo_optimizer_request` decides, from the checkpoint's metadata (names only), what a
load should ask for and how to complete what it got, and words the warning; the wrapped
``dist_checkpointing.load`` (:mod:`.core`) calls it and emits the warning as a
``MegatronPatchWarning``.

The code below is also what the source diff carries (see ``diff/core.py``): it is copied verbatim
into ``megatron/core/dist_checkpointing/serialization.py``, so it imports nothing at module level
and refers to nothing of this package.
"""

from __future__ import annotations


# -- replacement ---------------------------------------------------------------------------------
# (diff/core.py copies the code from here to the end marker into
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
# Each module's common state (its plain values; see common_state.py), written by this fix only.
_MIMO_COMMON_FIELD = "_mimo_common_state"
_MIMO_PLAIN_FIELDS = {
    "_mimo_param_groups": ("optimizer", "param_groups"),
    "_mimo_param_state_sharding_type": ("param_state_sharding_type",),
    "_mimo_grad_scaler": ("grad_scaler",),
}


def _mimo_get(tree, path):
    """The node at ``path`` in nested dicts/lists, or None."""
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and isinstance(key, int) and 0 <= key < len(tree):
            tree = tree[key]
        else:
            return None
    return tree


def _mimo_has(tree, path):
    parent = _mimo_get(tree, path[:-1])
    return isinstance(parent, dict) and path[-1] in parent


def _mimo_plain_paths(tree, path=()):
    """Paths of the plain values in a loaded (all-plain) tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _mimo_plain_paths(value, path + (key,))
    elif path:
        yield path


def _mimo_show(value):
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        return repr(value.item())
    return repr(value)


# The step Float16Optimizer/FP32Optimizer keep for all parameters (Adam's per-parameter 'step').
_MIMO_STEP = "common_step"


def _mimo_recover_common_state(loaded, lost):
    """Fill what a module's missing common-state object held, as far as the checkpoint allows.

    ``lost``: (path of the object in the request, module, the request's entries). The common state
    every rank loads is global rank 0's: a module there has its values; another module has none. A
    missing ``common_step`` under per-parameter state (torch Adam cannot load without it) is taken
    from a module that has one (MimoOptimizer steps every module together), else from this
    optimizer's own request; another missing value from the request. Returns the texts naming each.
    """
    recovered = []
    for path, module, requested in lost:
        sub = _mimo_get(loaded, path[:-1])
        at = max((i for i, part in enumerate(path[:-1]) if part == module), default=None)
        if not isinstance(sub, dict) or at is None:
            continue
        siblings = _mimo_get(loaded, path[:at])
        inner = path[at + 1 : -1]  # a chained optimizer's index, or nothing
        others = {
            name: _mimo_get(tree, inner)
            for name, tree in (siblings.items() if isinstance(siblings, dict) else ())
            if name != module
        }
        wanted = {tuple(p): v for p, v in (requested or [])}
        candidates = list(wanted)
        for other in others.values():
            for p in _mimo_plain_paths(other) if isinstance(other, dict) else ():
                if p[-1] == _MIMO_STEP and p not in candidates:
                    candidates.append(p)
        for p in candidates:
            if _mimo_has(sub, p):
                continue  # the common state had it (the module sits on global rank 0)
            source = None
            if p[-1] == _MIMO_STEP:
                state = _mimo_get(sub, p[:-1])
                if not (isinstance(state, dict) and state):
                    continue  # no per-parameter state here that needs a step
                source = next(
                    ((f"taken from module {name}: MimoOptimizer steps every module together", _mimo_get(o, p))
                     for name, o in sorted(others.items()) if _mimo_has(o, p)),
                    None,
                )
            if source is None and p in wanted:
                source = ("this optimizer's own value before the load", wanted[p])
            if source is None:
                continue
            node = sub
            for key in p[:-1]:
                node = node.setdefault(key, {})
            node[p[-1]] = source[1]
            name = ".".join(str(x) for x in (module,) + tuple(inner) + tuple(p))
            recovered.append(f"{name} = {_mimo_show(source[1])} ({source[0]})")
    return recovered


def _mimo_module_items(sharded_state_dict):
    """{module: [(path, item)]} of the MIMO optimizer's sharded items (keys ``mimo.<module>.<key>``)."""
    import re

    modules = {}
    mimo_key = re.compile(r"mimo\.([^.]+)\.")
    for path, item in _mimo_sharded_leaves(sharded_state_dict):
        match = mimo_key.match(item.key) if item.key.startswith("mimo.") else None
        if match:
            modules.setdefault(match.group(1), []).append((path, item))
    return modules


def _mimo_old_layout_modules(modules, names):
    """{module: [(path, item renamed)]} for each module saved in the unprefixed layout of unfixed
    0.17/0.18: none of its ``mimo.<module>.`` names in the checkpoint, some unprefixed one there."""
    import dataclasses

    old = {}
    for module, items in modules.items():
        prefix = f"mimo.{module}."
        if any(name.startswith(prefix) for name in names):
            continue  # the current layout: nothing to rename for this module
        renamed = [(path, dataclasses.replace(item, key=item.key[len(prefix):])) for path, item in items]
        if any(_mimo_stored_name(item) in names for _, item in renamed):
            old[module] = renamed
    return old


def _mimo_lost_common_states(modules, old, names):
    """(path, module, request's entries) of each module's common-state object the checkpoint lacks."""
    lost = []
    for module, items in modules.items():
        for path, item in old.get(module, items):
            field = str(path[-1]).split(".")[0]
            if field == _MIMO_COMMON_FIELD and _mimo_stored_name(item) not in names:
                lost.append((path, module, item.data))
    return lost


def _mimo_old_layout_request(sharded_state_dict, old, lost, names):
    """(request, missing): a copy of the request that asks for the old layout's names and not for
    what the checkpoint lacks; ``missing``: (path, module, value requested) of the plain objects
    the old layout did not store."""
    request = _mimo_copy_containers(sharded_state_dict)
    missing = []
    for module, renamed in old.items():
        for path, item in renamed:
            field = str(path[-1]).split(".")[0]
            if field in _MIMO_PLAIN_FIELDS and _mimo_stored_name(item) not in names:
                missing.append((path, module, item.data))
            else:
                _mimo_set(request, path, item)
    for path in [m[0] for m in missing] + [m[0] for m in lost]:
        del _mimo_get(request, path[:-1])[path[-1]]
    return request, missing


def _mimo_fill_missing(loaded, missing):
    """Put each missing plain value the common state did not bring back into ``loaded``; returns
    the texts naming what was assumed."""
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
    return assumed


def _mimo_old_layout_warning(checkpoint_dir, old, assumed):
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


def _mimo_lost_common_state_warning(checkpoint_dir, recovered):
    modules_here = sorted({name.split(".")[0] for name in recovered})
    return (
        f"{checkpoint_dir} holds no per-module common state for the MIMO optimizer module(s) "
        f"{', '.join(modules_here)} (saved without it: by Megatron-Core 0.17-0.19.2, patched by an "
        f"earlier mcore_ckpt_fixes or not): a module's plain optimizer state is only in the common "
        f"state, which global rank 0 writes, so theirs is not in the checkpoint; in its place: "
        + ", ".join(recovered) + "; the next save writes the current layout"
    )


def align_mimo_optimizer_request(sharded_state_dict, checkpoint_dir):
    """(request, finish): what ``dist_checkpointing.load`` should ask for, and ``finish(loaded)``,
    which completes the loaded state dict and returns the warnings to give (a list, maybe empty).

    A MIMO optimizer module whose keys (``mimo.<module>.<key>``) are absent from the checkpoint
    while the unprefixed ``<key>`` names are there was saved by an unfixed Megatron-Core
    0.17/0.18: ask for the unprefixed names. What that layout did not store for a module (0.17
    keeps the sharding type in the common state, which only global rank 0 writes) is filled with
    the value the load requested: the module's optimizer keys are that sharding type's keys, or
    the load would already fail on them. A module's common-state object (``..common_state``)
    that the checkpoint lacks (every unfixed release, and earlier versions of this fix) is not
    asked for; what it would have held is recovered where the checkpoint allows, with a warning
    naming each value (:func:`_mimo_recover_common_state`). The caller's dict is left as built.
    """
    modules = _mimo_module_items(sharded_state_dict)
    if not modules:
        return sharded_state_dict, lambda loaded: []
    names = _mimo_checkpoint_names(checkpoint_dir)
    old = _mimo_old_layout_modules(modules, names)
    lost = _mimo_lost_common_states(modules, old, names)
    if not old and not lost:
        return sharded_state_dict, lambda loaded: []  # the current layout, or unknown: load reports it
    request, missing = _mimo_old_layout_request(sharded_state_dict, old, lost, names)

    def finish(loaded):
        texts = []
        assumed = _mimo_fill_missing(loaded, missing)
        if old:
            texts.append(_mimo_old_layout_warning(checkpoint_dir, old, assumed))
        recovered = _mimo_recover_common_state(loaded, lost) if isinstance(loaded, dict) else []
        if recovered:
            texts.append(_mimo_lost_common_state_warning(checkpoint_dir, recovered))
        return texts

    return request, finish


# -- end of replacement ---------------------------------------------------------------------------
