"""mimo-optimizer, defect (e): each module's plain (non-sharded) optimizer state kept with its module.

``dist_checkpointing`` writes everything in a state dict that is not a ``ShardedBase`` (the "common
state") from global rank 0 only, and every rank loads rank 0's copy. That is right for a model whose
ranks all hold the same common state; in a non-colocated MIMO model rank 0 holds one module only.
The plain values an inner optimizer returns are lost for every other module: Megatron's
``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` over torch's Adam/AdamW (what Megatron
falls back to without Transformer Engine or Apex) keep the shared per-parameter ``step`` as
``optimizer.state.common_step``, so a module off global rank 0 loads exp_avg/exp_avg_sq without a
step and torch's ``Adam.__setstate__`` raises ``KeyError: 'step'``.

:func:`_extract_common_state` copies every plain value of a module's optimizer sub-dict (whole plain
subtrees, with their paths) into one more per-module ``ShardedObject``
(``optimizer.mimo.<module>[.<i>].common_state``, replica id (tp, pp, dp) like the module's other
objects); the values also stay where they were, so the common state rank 0 writes is unchanged and
every loader that read a checkpoint before reads this one the same way. :func:`_restore_common_state`
puts the module's own values back before the inner optimizer loads. The object is written even when
empty and always requested on load (a fresh optimizer has no ``step`` before its first step, but the
checkpoint's does); checkpoints without it are handled by ``old_layouts.align_mimo_optimizer_request``.

The code between the markers is also what the source diff puts into
``megatron/core/models/mimo/optimizer.py`` (see ``diff/core.py``): self-contained, imports inside.
"""

from __future__ import annotations


# -- replacement ---------------------------------------------------------------------------------
# (diff/core.py copies the code from here to the end marker into
# megatron/core/models/mimo/optimizer.py for patches/mimo-optimizer/: keep it self-contained.)


def _mimo_kept_per_rank(value):
    """Values ``dist_checkpointing`` saves or restores on every rank (not common state)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    return isinstance(value, (ShardedBase, LocalNonpersistentObject))


def _mimo_holds_per_rank(value):
    if _mimo_kept_per_rank(value):
        return True
    if isinstance(value, dict):
        return any(_mimo_holds_per_rank(v) for v in value.values())
    if isinstance(value, list):
        return any(_mimo_holds_per_rank(v) for v in value)
    return False


def _mimo_common_entries(sub_sd):
    """``[[path, value], ...]``: every maximal subtree of ``sub_sd`` with nothing per-rank inside,
    i.e. exactly what ``dist_checkpointing`` would write as common state (global rank 0 only)."""
    entries = []
    stack = [((), sub_sd)]
    while stack:
        path, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if not path and isinstance(key, str) and key.startswith('_mimo_'):
                continue  # MimoOptimizer's own per-module objects
            if _mimo_kept_per_rank(value):
                continue
            if isinstance(value, (dict, list)) and _mimo_holds_per_rank(value):
                stack.append((path + (key,), value))
            else:
                entries.append([list(path + (key,)), value])
    entries.sort(key=lambda e: [str(p) for p in e[0]])
    return entries


def _extract_common_state(sub_sd, module_name, suffix, replica_id):
    """Save: copy the module's common state into a per-module ShardedObject (always written)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sub_sd[f'_mimo_common_state{suffix}'] = ShardedObject(
        f'optimizer.mimo.{module_name}{suffix}.common_state',
        _mimo_common_entries(sub_sd),
        (1,),
        (0,),
        replica_id=replica_id,
    )


def _restore_common_state(sub_sd):
    """Load: put the module's own common state back (over rank 0's, which may be another module's)."""
    key = next(
        (k for k in list(sub_sd) if isinstance(k, str) and k.startswith('_mimo_common_state')), None
    )
    if key is None:
        return
    for path, value in sub_sd.pop(key) or []:
        node = sub_sd
        for part in path[:-1]:
            if isinstance(node, dict):
                node = node.setdefault(part, {})
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                node = None
                break
        if isinstance(node, dict):
            node[path[-1]] = value
        elif isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node):
            node[path[-1]] = value


# -- end of replacement ---------------------------------------------------------------------------
