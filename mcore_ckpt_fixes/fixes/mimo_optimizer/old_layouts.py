"""mimo-optimizer, load side: reading the MIMO optimizer layout unfixed Megatron-Core 0.17/0.18 wrote.

In the configurations an unpatched 0.17/0.18 can save (one module with an optimizer, e.g. a frozen
encoder) its MIMO optimizer keys carry no ``mimo.<module>.`` prefix and, on 0.17, the sharding type
sits in the common state that only global rank 0 writes (so a module on another rank has none).
:func:`align_mimo_optimizer_request` decides, from the checkpoint's metadata (names only), what a
load should ask for and how to complete what it got, and words the warning; the wrapped
``dist_checkpointing.load`` (:mod:`.patch`) calls it and emits the warning as a
``MegatronPatchWarning``.

The code below is also what the source diff carries (see :mod:`.upstream`): it is copied verbatim
into ``megatron/core/dist_checkpointing/serialization.py``, so it imports nothing at module level
and refers to nothing of this package.
"""

from __future__ import annotations


# -- replacement ---------------------------------------------------------------------------------
# (upstream.py copies the code from here to the end marker into
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
