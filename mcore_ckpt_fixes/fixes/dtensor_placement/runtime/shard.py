"""dtensor-placement's ``_dtensor_shard_for_checkpoint``: the ShardedTensor of a DTensor's local shard,
placed by the DTensor's own mesh and placements.

:mod:`.core` calls it for a sharded DTensor (after :func:`.core.dtensor_layout` has checked the
placements), and the source diff (``diff/core.py``) inserts the code between the "replacement"
markers below, verbatim, into the release's ``megatron/core/utils.py``: the runtime and the diff are
the same code. It is written as that module's own code: ``ShardedTensor``, ``Shard`` and
``is_torch_min_version`` are the names ``megatron/core/utils.py`` has; here :func:`bind` sets them
from the release before the first call. Nothing is imported from torch or Megatron at import.

Its layout is the diff's layout: ruff does not reformat this file.
"""

from __future__ import annotations

# The names the replacement uses, as megatron/core/utils.py binds them (set by bind()).
ShardedTensor = Shard = is_torch_min_version = None


def bind(utils) -> None:
    """Give the replacement the names it has where the diff puts it, from the release (``utils``:
    ``megatron.core.utils``)."""
    global ShardedTensor, Shard, is_torch_min_version
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.tensor import Shard

    is_torch_min_version = utils.is_torch_min_version


# -- replacement ---------------------------------------------------------------------------------
# (diff/core.py copies the code from here to the end marker into megatron/core/utils.py, before
# make_tp_sharded_tensor_for_checkpoint, for patches/dtensor-placement/.)

def _dtensor_shard_for_checkpoint(
    tensor, key, prepend_offsets, tp_axis, tp_rank, tp_size, tp_replica, replica_id, kwargs
):
    """ShardedTensor of a DTensor's local shard, placed by the DTensor's own mesh and placements.

    Shard(d) on a mesh dim cuts the current extent of dim d into torch chunks (ceil(n / mesh
    size) each, mesh dims in order); Replicate dims give the DP replica index; TP (outside the
    DTensor) is merged on ``tp_axis`` (None: not TP-sharded). Uneven shards get an irregular grid.
    Returns (ShardedTensor, replica index); the ShardedTensor is None for a DTensor that is not
    sharded (the caller takes the plain path with that replica index: the DTensor's mesh holds
    every copy of its data, so on a size-1 mesh this rank is the main replica).
    """
    from torch.distributed.tensor import Replicate

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(
            f"{key}: this rank is not in the DTensor's device mesh; "
            "accepted: a DTensor whose mesh includes this rank"
        )
    global_shape = list(tensor.shape)
    offset, extent = [0] * len(global_shape), list(global_shape)
    replica, even, sharded = 0, True, False
    for i, placement in enumerate(placements):
        n = tuple(mesh.shape)[i]
        if type(placement) is Replicate:
            replica = replica * n + coord[i]
        elif type(placement) is Shard:
            d = placement.dim % len(global_shape)
            size = extent[d]
            chunk = -(-size // n) if size else 0
            start = min(coord[i] * chunk, size)
            offset[d] += start
            extent[d] = max(0, min(chunk, size - start))
            even = even and size % n == 0
            sharded = sharded or n > 1
        else:
            raise ValueError(
                f"{key}: cannot checkpoint a DTensor placed {placement!r} on mesh dim {i}; "
                "accepted: Shard(dim), Replicate()"
            )
    local = tensor._local_tensor
    if tuple(extent) != tuple(local.shape):
        raise ValueError(
            f"{key}: local shard {tuple(local.shape)} does not match placements {placements} of "
            f"global shape {tuple(tensor.shape)} (expected {tuple(extent)}); "
            "accepted: torch's Shard chunking (ceil(n/mesh) per shard)"
        )
    if not sharded:
        return None, replica
    if tp_axis is not None and tp_size > 1:
        # TP outside, the DTensor inside the TP-local tensor.
        offset[tp_axis] += tp_rank * global_shape[tp_axis]
        global_shape[tp_axis] *= tp_size
    if replica_id is None:
        replica_id = (0, tp_replica, replica)
    prepend_axis_num = len(prepend_offsets)
    if even and all(le > 0 for le in local.shape):
        rank_offsets = [
            (prepend_axis_num + d, offset[d] // le, global_shape[d] // le)
            for d, le in enumerate(local.shape)
            if global_shape[d] != le
        ]
        sh_ten = ShardedTensor.from_rank_offsets(
            key,
            local,
            *prepend_offsets,
            *rank_offsets,
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            **kwargs,
        )
    else:
        if not is_torch_min_version("2.6a0"):
            raise ValueError(
                f"{key}: uneven DTensor shards (local {tuple(local.shape)} of "
                f"{tuple(tensor.shape)}) need PyTorch >= 2.6 for dist_checkpointing; "
                "accepted: each sharded dim divisible by its mesh size"
            )
        pre_shape, pre_offset = [1] * prepend_axis_num, [0] * prepend_axis_num
        for axis, axis_rank_offset, axis_fragm in prepend_offsets:
            pre_shape[axis], pre_offset[axis] = axis_fragm, axis_rank_offset
        sh_ten = ShardedTensor(
            key,
            local,
            local.dtype,
            tuple(local.shape),
            tuple(pre_shape + global_shape),
            tuple(pre_offset + offset),
            None,  # irregular grid: dist_checkpointing defers the coverage check to DCP
            replica_id,
            prepend_axis_num,
            **kwargs,
        )
    # Its replica index comes from its mesh: SequentialMLP must not overwrite it.
    sh_ten.is_torch_fsdp2_param = True
    return sh_ten, replica


# -- end of replacement ---------------------------------------------------------------------------
