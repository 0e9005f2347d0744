"""A ``torch_dist`` checkpoint read back whole, in one process: every tensor at its global shape and
the common state. What a resume on another layout is compared by (the loading layout's shards are
not the saving layout's, the full tensors are)."""

from __future__ import annotations

import os


def full_tensors(ckpt_dir: str) -> dict:
    """Every tensor of a ``torch_dist`` checkpoint directory at its global shape, read through DCP
    in this process alone (no process group: ``no_dist``)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(ckpt_dir)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def common_state(ckpt_dir: str) -> dict:
    """The checkpoint's common state (``common.pt`` up to 0.18, embedded from 0.19), as Megatron reads it."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(ckpt_dir)


def latest_iteration_dir(root: str) -> str:
    """The ``iter_*`` directory the tracker file of ``root`` names."""
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(root, f"iter_{int(f.read().strip()):07d}")


def _members(optimizer_state):
    """The per-optimizer entries of a checkpoint's common optimizer state: a chain of several saves
    one entry per optimizer, by position; one optimizer saves its entry flat."""
    if isinstance(optimizer_state, dict) and optimizer_state and all(isinstance(k, int) for k in optimizer_state):
        return [optimizer_state[k] for k in sorted(optimizer_state)]
    if isinstance(optimizer_state, (list, tuple)):
        return list(optimizer_state)
    return [optimizer_state]


def chain_length(optimizer_state) -> int:
    """How many optimizers saved a checkpoint's common optimizer state."""
    return len(_members(optimizer_state))


def optimizer_state_by_kind(optimizer_state) -> tuple:
    """A checkpoint's common optimizer state whatever the shape of the chain that saved it (under
    expert parallelism a dense and an expert optimizer, without it one for all): the optimizers'
    other entries (``param_state_sharding_type``, ...) and their parameter groups without the
    parameter indices and the expert flag (every group's hyperparameters and ``step``), each once."""
    entries, groups = set(), set()
    for member in _members(optimizer_state):
        if not isinstance(member, dict):
            entries.add(repr(member))
            continue
        for key, value in member.items():
            if key != "optimizer":
                entries.add(repr((key, value)))
        inner = member.get("optimizer")
        for group in inner.get("param_groups", ()) if isinstance(inner, dict) else ():
            groups.add(repr(sorted((k, v) for k, v in group.items() if k not in ("params", "is_expert_parallel"))))
    return sorted(entries), sorted(groups)
