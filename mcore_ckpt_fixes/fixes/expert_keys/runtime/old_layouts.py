"""expert-keys, reading what an unfixed release wrote (monkeypatch only; not in the source diff).

Under EP > 1 an unfixed release stored expert biases under local indices (every EP rank wrote the
same keys, one copy kept) and single grouped expert tensors with their EP-local shape. A fixed load
asks for other keys and shapes; these functions look at the checkpoint's DCP metadata (keys and
sizes, no tensor data), point the load of grouped tensors at what is stored, and return the warning
text. core.py's ``print_diff_in_state_dicts`` wrapper calls them and warns.
"""

from __future__ import annotations

import re

from .. import MODULE
from .keys import _ep_size_and_rank

# Any expert tensor key of a TE grouped MLP, model or optimizer state ('optimizer.state.<name>.exp_avg').
_INDEXED_EXPERT_KEY = re.compile(
    r"^(?P<head>(?:.*\.)?mlp\.experts\.linear_fc\d\.)(?P<kind>weight|bias)(?P<index>\d+)(?P<tail>(?:_[wv])?(?:\..*)?)$"
)
_NAMED_KEYS = 16  # keys spelled out in the warning; the rest are counted


def _old_bias_groups(meta_keys):
    """{(head, tail): (bias indices, weight indices)} where the checkpoint holds expert biases under
    fewer, lower indices than the weights: the unfixed layout (weights global, biases local)."""
    found = {}
    for key in meta_keys:
        m = _INDEXED_EXPERT_KEY.match(key)
        if m is not None:
            found.setdefault((m["head"], m["tail"]), ({}, {}))[m["kind"] == "weight"][int(m["index"])] = None
    old = {}
    for group, (biases, weights) in found.items():
        only_weights = set(weights) - set(biases)
        if biases and set(biases) < set(weights) and max(biases) < min(only_weights):
            old[group] = (sorted(biases), sorted(weights))
    return old


def old_expert_bias_layout_warning(state_dict_metadata, load_state_dict):
    """The warning text for loading ``load_state_dict`` from a checkpoint whose DCP metadata
    (``Metadata.state_dict_metadata``: keys only, no tensor data) has the unfixed bias layout, else None."""
    import sys

    old = _old_bias_groups(state_dict_metadata)
    if not old:
        return None
    module = sys.modules[MODULE]
    load_keys = module.flatten_state_dict(load_state_dict)
    missing = []
    for key in load_keys:
        m = _INDEXED_EXPERT_KEY.match(key)
        if m is not None and m["kind"] == "bias" and (m["head"], m["tail"]) in old and key not in state_dict_metadata:
            missing.append(key)
    missing.sort()
    (head, tail), (biases, weights) = sorted(old.items())[0]
    ep_size, ep_rank = _ep_size_and_rank()
    text = (
        f"expert-keys: this fsdp_dtensor checkpoint has the expert-bias layout of an unfixed Megatron-Core: "
        f"expert biases are stored under local indices (e.g. {head}bias{{{biases[0]}..{biases[-1]}}}{tail}) "
        f"while expert weights carry global indices ({head}weight{{{weights[0]}..{weights[-1]}}}{tail}); "
        f"every EP rank wrote the same bias keys, so only one EP rank's copy of the expert biases was saved. "
    )
    where = f"EP rank {ep_rank} of {ep_size}"
    if missing:
        named = ", ".join(repr(k) for k in missing[:_NAMED_KEYS])
        more = f" and {len(missing) - _NAMED_KEYS} more" if len(missing) > _NAMED_KEYS else ""
        text += (
            f"{where}: {len(missing)} expert bias keys are not in the checkpoint and keep their current "
            f"values (not loaded): {named}{more}. "
        )
    else:
        text += (
            f"{where}: its expert bias keys are in the checkpoint and load that one saved copy (the best "
            f"state there is; it may hold another EP rank's experts). "
        )
    return text + "Save again with the fix on to store every EP rank's expert biases."


def align_old_grouped_expert_layout(state_dict_metadata, load_state_dict):
    """Point the load of each single grouped expert tensor stored in the unfixed layout at what is
    stored, and return the warning text (None when nothing is in that layout).

    An unfixed release writes a grouped tensor under EP with its EP-local shape ``(n, ...)`` from
    every EP rank, and DCP keeps one copy. A fixed load asks for the global ``(ep * n, ...)`` tensor,
    which DCP would refuse (``Size mismatch``). As for indexed biases in the old layout: EP rank 0
    (whose global rows are the stored rows) loads that one copy, the best state there is; the other
    EP ranks do not load it and keep their current values. ``load_state_dict`` is the dict the
    partial load reads next; the dicts holding these tensors are the preprocessing's own copies.
    """
    ep_size, ep_rank = _ep_size_and_rank()
    old = []  # (flat key, stored shape, requested shape)

    def visit(mapping, prefix):
        for key in list(mapping):
            value, flat = mapping[key], f"{prefix}{key}"
            if isinstance(value, dict):
                visit(value, f"{flat}.")
                continue
            local = getattr(value, "_ep_local_dtensor", None)
            stored = getattr(state_dict_metadata.get(flat), "size", None)
            if local is None or stored is None or tuple(stored) != tuple(local.shape):
                continue
            old.append((flat, tuple(stored), tuple(value.shape)))
            if ep_rank == 0:
                mapping[key] = local
            else:
                del mapping[key]

    visit(load_state_dict, "")
    if not old:
        return None
    flat, stored, wanted = old[0]
    named = ", ".join(repr(k) for k, _, _ in old[:_NAMED_KEYS])
    more = f" and {len(old) - _NAMED_KEYS} more" if len(old) > _NAMED_KEYS else ""
    what = (
        "loads that one saved copy (the best state there is; it may hold another EP rank's experts)"
        if ep_rank == 0
        else "does not load them: they keep their current values (not loaded)"
    )
    return (
        f"expert-keys: this fsdp_dtensor checkpoint stores single grouped expert tensors in the layout of an "
        f"unfixed Megatron-Core: {flat!r} has shape {stored}, one EP rank's experts, where the model's "
        f"global tensor is {wanted}; every EP rank wrote the same key, so only one EP rank's copy was "
        f"saved. EP rank {ep_rank} of {ep_size} {what}: {len(old)} tensors: {named}{more}. "
        f"Save again with the fix on to store every EP rank's experts."
    )
