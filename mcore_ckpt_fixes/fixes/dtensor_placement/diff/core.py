"""dtensor-placement as Megatron-Core would carry it: the code of patches/dtensor-placement/<release>.patch
and its source edits, per release.

The edits mirror the monkeypatch (``runtime/core.py``) in effect:

* megatron/core/utils.py (0.12-0.19; on 0.12-0.15 the helpers read parallel_state, so the TP rank
  does too): a DTensor the release's helper treats as one (every DTensor up to 0.18;
  on 0.19 those tagged ``is_torch_fsdp2_param``) is described from its own mesh and placements by
  ``_dtensor_shard_for_checkpoint`` before the release's dense-DP branch is reached; an
  all-Replicate DTensor (or one on a size-1 mesh) continues on the plain path with its local tensor
  and the replica index its own mesh gives, not the dense DP group's;
* megatron/core/transformer/moe/experts.py: SequentialMLP keeps the replica index of those shards
  (tagged ``is_torch_fsdp2_param``) instead of overwriting it with the expert-DP rank.

``_dtensor_shard_for_checkpoint`` is written as the release's own code (it uses ``ShardedTensor``,
``Shard`` and ``is_torch_min_version`` as ``megatron/core/utils.py`` imports them); the monkeypatch
computes the same layout with ``dtensor_layout`` and ``build_sharded_tensor`` (``runtime/core.py``).
tests/patches/test_source_patches.py checks that the patched source satisfies every probe of the
fix and round-trips with the monkeypatch off.

    python tools/patchgen dtensor-placement SRC_ROOT RELEASE > patches/dtensor-placement/RELEASE.patch

SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...). Imports no torch or megatron.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, Transform, insert_after

UTILS = "megatron/core/utils.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"
TAG_TEST = 'hasattr(tensor, "is_torch_fsdp2_param")'

# The helper the diff adds to megatron/core/utils.py, before make_tp_sharded_tensor_for_checkpoint.
HELPER_CODE = '''def _dtensor_shard_for_checkpoint(
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


'''

ANCHOR = "    dp_replica_id = get_pg_rank(dp_cp_group)\n"
# 0.12-0.15: the helpers take no groups and read parallel_state.
LEGACY_ANCHOR = "    dp_replica_id = parallel_state.get_data_parallel_rank(with_context_parallel=True)\n"


def _branch(tag, call):
    """The DTensor branch each helper gets right after its dense-DP replica id is computed."""
    cond = "HAVE_DTENSOR and isinstance(tensor, DTensor)" + (f" and {TAG_TEST}" if tag else "")
    return (
        f"\n    if {cond}:\n"
        "        # Offsets, global shape and replica id from the DTensor's own mesh and placements.\n"
        f"        sh_ten, mesh_replica_id = _dtensor_shard_for_checkpoint({call})\n"
        "        if sh_ten is not None:\n"
        "            return sh_ten\n"
        "        # Not sharded: the plain path, nothing gathered; a replica only across its own mesh.\n"
        "        tensor, dp_replica_id = tensor._local_tensor, mesh_replica_id\n"
    )


def _insert_after(text, func, anchor, insert):
    """``insert`` after ``anchor``, searched inside function ``func`` only (both helpers share it)."""
    start = text.index(f"\ndef {func}(")
    at = text.index(anchor, start) + len(anchor)
    end = text.find("\ndef ", start + 1)
    if end != -1 and at > end:
        raise PatchgenError(f"anchor not found in {func}: {anchor!r}")
    return text[:at] + insert + text[at:]


def patch_utils(text):
    """megatron/core/utils.py: the DTensor branch in both helpers, and the helper they call."""
    tag = TAG_TEST in text  # 0.19 enters its DTensor branch only for tagged tensors
    legacy = ANCHOR not in text
    anchor = LEGACY_ANCHOR if legacy else ANCHOR
    tp_rank = "parallel_state.get_tensor_model_parallel_rank()" if legacy else "get_pg_rank(tp_group)"
    text = _insert_after(
        text,
        "make_tp_sharded_tensor_for_checkpoint",
        anchor,
        _branch(
            tag,
            "\n            tensor, key, prepend_offsets, tp_axis, tp_rank, tp_size, 0, replica_id, kwargs\n        ",
        ),
    )
    text = _insert_after(
        text,
        "make_sharded_tensor_for_checkpoint",
        anchor,
        _branch(
            tag,
            "\n            tensor,\n            key,\n            prepend_offsets,\n            None,\n            0,\n"
            f"            1,\n            {tp_rank},\n            replica_id,\n            kwargs,\n        ",
        ),
    )
    at = text.index("\ndef make_tp_sharded_tensor_for_checkpoint(") + 1
    return text[:at] + HELPER_CODE + text[at:]


# SequentialMLP.sharded_state_dict's loop over its experts' ShardedTensors (every release).
EXPERTS_ANCHOR = "            for k, sh_ten in expert_state_dict.items():\n"
EXPERTS_SKIP = (
    '                if getattr(sh_ten, "is_torch_fsdp2_param", False):\n'
    "                    continue  # described from its DTensor's mesh, replica index included\n"
)


def source_edits(release: str) -> list:
    """The same edits for every release: :func:`patch_utils` reads from the file which helper
    signatures (groups or parallel_state) and DTensor test (tagged or not) the release has."""
    return [Transform(UTILS, patch_utils), insert_after(EXPERTS, EXPERTS_ANCHOR, EXPERTS_SKIP)]
