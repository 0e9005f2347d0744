"""expert-keys' replacements: expert keys with global indices (biases as well as weights), single
grouped expert tensors made EP-global.

:mod:`.core` binds marked wrappers around these functions in a user's job. The source diff
(``diff/core.py``) replaces upstream's ``get_expert_index_from_key``, ``handle_experts_in_state_dict``
and ``expert_param_local_key`` in ``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` by the code
between the "replacement" markers below, verbatim except for one mechanical edit:
``sys.modules[MODULE]`` (the upstream module, seen from the fix) is read as ``sys.modules[__name__]``.

Its layout is the diff's layout: ruff does not reformat this file.
"""

from __future__ import annotations

import re

from .. import MODULE

# -- replacement ---------------------------------------------------------------------------------
# (``diff/core.py`` copies the code from here to the end marker into the upstream file for
# patches/expert-keys/: keep it self-contained, ``re`` and ``sys`` only. core.py binds marked
# wrappers around these functions; nothing here imports torch or megatron at import.)

# TE grouped experts: 'mlp.experts.linear_fc1.weight3', '...linear_fc2.bias3', SwiGLU halves
# '...linear_fc1.weight3_w' / '_v'; no index: one grouped tensor of all local experts (0.18+).
_GROUPED_EXPERT_KEY = re.compile(
    r"^(?P<head>(?:.*\.)?mlp\.experts\.linear_fc\d\.(?:weight|bias))(?P<index>\d*)(?P<tail>_[wv])?$"
)
# SequentialMLP: 'mlp.experts.local_experts.3.linear_fc1.weight' (weights and biases alike).
_SEQUENTIAL_EXPERT_KEY = re.compile(r"^(?P<head>(?:.*\.)?mlp\.experts\.local_experts\.)(?P<index>\d+)(?P<tail>\..+)$")


def _parse_expert_key(key):
    """(head, index or None, tail) for an expert key, None for any other key."""
    m = _GROUPED_EXPERT_KEY.match(key) or _SEQUENTIAL_EXPERT_KEY.match(key)
    if m is None:
        return None
    return m.group("head"), (int(m.group("index")) if m.group("index") else None), m.group("tail") or ""


def _ep_size_and_rank():
    """(EP size, EP rank) of this rank, from parallel_state."""
    import sys

    # fsdp_dtensor_checkpoint's parallel_state.
    ps = sys.modules[MODULE].parallel_state
    # 0 (or None) when parallel_state is not initialised (a single-process conversion script): one
    # EP rank. (upstream's get_ep_layer_offset divides by it.)
    return max(ps.get_expert_model_parallel_world_size() or 1, 1), ps.get_expert_model_parallel_rank() or 0


def _ep_layout(num_experts):
    """(ep_size, ep_rank, num_local_experts, offset of this rank's first expert)."""
    ep_size, ep_rank = _ep_size_and_rank()
    num_local = num_experts // ep_size
    return ep_size, ep_rank, num_local, ep_rank * num_local


def get_expert_index_from_key(key):
    """The expert index in an expert key (weights and biases, TE grouped or SequentialMLP), else None.

    None also for a single grouped tensor (``...linear_fc1.weight``): it has no per-expert index.
    """
    parsed = _parse_expert_key(key)
    return None if parsed is None else parsed[1]


def handle_experts_in_state_dict(state_dict, num_experts=None):
    """Rename this EP rank's expert keys from local to global expert indices (weights and biases).

    Returns a copy; values are untouched (the optimizer maps parameters to names by identity).
    """
    parsed = {k: p for k, p in ((k, _parse_expert_key(k)) for k in state_dict) if p is not None}
    if not parsed:
        return state_dict.copy()
    if not num_experts:
        example = next(iter(parsed))
        raise ValueError(
            f"handle_experts_in_state_dict: num_experts={num_experts!r} but the state dict has expert "
            f"keys (e.g. {example!r}); pass the model's total number of experts "
            f"(config.num_moe_experts, an int > 0)"
        )
    ep_size, ep_rank, num_local, offset = _ep_layout(num_experts)
    renamed = {}
    for key, (head, index, tail) in parsed.items():
        if index is None:
            if ep_size > 1 and tail:
                raise ValueError(
                    f"handle_experts_in_state_dict: {key!r} is a SwiGLU half of one grouped tensor of "
                    f"this rank's {num_local} experts, which fsdp_dtensor checkpoints cannot place among "
                    f"the experts of other EP ranks (expert_model_parallel_size={ep_size}); accepted: "
                    f"per-expert tensors (moe_single_grouped_weight=False, moe_single_grouped_bias=False), "
                    f"swiglu=False, or expert_model_parallel_size=1"
                )
            # The key stays: EP = 1 holds every expert; under EP > 1 the tensor itself is described
            # as its EP block of the global tensor (handle_grouped_experts_in_state_dict).
            continue
        if offset <= index < offset + num_local:
            continue  # already this rank's global index (rank 0: local == global)
        if not 0 <= index < num_local:
            raise ValueError(
                f"handle_experts_in_state_dict: expert index {index} in {key!r} is neither a local "
                f"index (0..{num_local - 1}) nor one of EP rank {ep_rank}'s global indices "
                f"({offset}..{offset + num_local - 1}) for num_experts={num_experts}, "
                f"expert_model_parallel_size={ep_size}"
            )
        renamed[key] = f"{head}{index + offset}{tail}"
    out = state_dict.copy()
    out.clear()  # same mapping type as the input, keys in the input's order
    for key, value in state_dict.items():
        new_key = renamed.get(key, key)
        if new_key in out:
            raise ValueError(f"handle_experts_in_state_dict: {key!r} and another key both map to {new_key!r}")
        out[new_key] = value
    return out


def expert_param_local_key(key, num_experts=None):
    """The local parameter name of a key that carries a global expert index (weights and biases)."""
    parsed = _parse_expert_key(key)
    if parsed is None or parsed[1] is None or not num_experts:
        return key  # not an expert key, a grouped tensor without index, or nothing was renamed
    head, index, tail = parsed
    ep_size, ep_rank, num_local, offset = _ep_layout(num_experts)
    if not offset <= index < offset + num_local:
        raise ValueError(
            f"expert_param_local_key: expert index {index} in {key!r} is not one of EP rank {ep_rank}'s "
            f"global indices ({offset}..{offset + num_local - 1}) for num_experts={num_experts}, "
            f"expert_model_parallel_size={ep_size}"
        )
    return f"{head}{index - offset}{tail}"


def _is_single_grouped_expert_key(key):
    """A TE grouped-experts key without expert index (and without SwiGLU half): one tensor of all
    of this rank's experts, dim 0 the local expert (``moe_single_grouped_weight`` / ``_bias``)."""
    parsed = _parse_expert_key(key) if isinstance(key, str) else None
    return parsed is not None and parsed[1] is None and not parsed[2]


def _write_one_chunk(chunk, fqn, tensor):
    """DCP write items of a DTensor whose local data is exactly ``chunk`` of the global tensor."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = tensor.to_local()
    if local.numel() == 0:
        return []  # an empty FSDP shard: nothing of this tensor lives on this rank
    data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=tensor.size())
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]


def _ep_global_grouped_dtensor(key, dtensor, ep_size, ep_rank):
    """``dtensor`` (this EP rank's grouped experts, already given its chunk over the expert-data-
    parallel mesh) described as rows ``ep_rank * n ... (ep_rank + 1) * n`` of the global tensor of
    all ``ep_size * n`` experts. Same storage: a DCP load writes into the parameter."""
    import functools

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor import DTensor

    if getattr(dtensor, "_ep_global_grouped_experts", False):
        return dtensor  # preprocessed twice: already global
    local = dtensor._local_tensor
    chunks = local.__create_chunk_list__() if hasattr(local, "__create_chunk_list__") else None
    if not chunks or len(chunks) != 1:
        raise ValueError(
            f"handle_grouped_experts_in_state_dict: {key!r} has no uneven-DTensor chunk metadata; "
            f"accepted: a state dict after preprocess_state_dict_for_uneven_dtensor (Megatron-FSDP)"
        )
    (chunk,) = chunks
    rows = dtensor.shape[0]
    shape = torch.Size((rows * ep_size, *dtensor.shape[1:]))
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    offsets = torch.Size((chunk.offsets[0] + ep_rank * rows, *chunk.offsets[1:]))
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=chunk.sizes)
    out = DTensor.from_local(
        local.detach(), dtensor.device_mesh, dtensor.placements, run_check=False, shape=shape, stride=tuple(stride)
    )
    out._local_tensor.__create_chunk_list__ = functools.partial(list, (chunk,))
    out._local_tensor.__create_write_items__ = functools.partial(_write_one_chunk, chunk)
    out._ep_global_grouped_experts = True
    out._ep_local_dtensor = dtensor  # what this rank asked for before: a load of an older layout reads it
    return out


def handle_grouped_experts_in_state_dict(state_dict):
    """Under EP > 1, describe every single grouped expert tensor (model and optimizer state) as
    this EP rank's block of the global tensor of all experts, so EP ranks write disjoint chunks
    of one key and each loads its own. Run after Megatron-FSDP's uneven-DTensor preprocessing.

    Updates ``state_dict`` in place at the top level; dicts below it on the path to a changed
    tensor are copied, never modified. Returns ``state_dict``.
    """
    from torch.distributed.tensor import DTensor

    ep_size, ep_rank = _ep_size_and_rank()
    if ep_size == 1:
        return state_dict

    def visit(mapping, grouped):
        changed = None
        for key, value in mapping.items():
            under = grouped or _is_single_grouped_expert_key(key)
            if isinstance(value, dict):
                new = visit(value, under)
            elif under and isinstance(value, DTensor):
                new = _ep_global_grouped_dtensor(key, value, ep_size, ep_rank)
            else:
                continue
            if new is not value:
                changed = mapping.copy() if changed is None else changed
                changed[key] = new
        return mapping if changed is None else changed

    state_dict.update(visit(state_dict, False))
    return state_dict


def _megatron_fsdp_uneven_dtensor_preprocessing(state_dict):
    """Megatron-FSDP's own uneven-DTensor preprocessing (the chunk metadata of every DTensor)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    uneven_dtensor.preprocess_state_dict_for_uneven_dtensor(state_dict)


def preprocess_state_dict_for_uneven_dtensor(state_dict):
    """Megatron-FSDP's uneven-DTensor preprocessing, then single grouped expert tensors made
    EP-global (:func:`handle_grouped_experts_in_state_dict`)."""
    _megatron_fsdp_uneven_dtensor_preprocessing(state_dict)
    return handle_grouped_experts_in_state_dict(state_dict)


# -- end of replacement ---------------------------------------------------------------------------
