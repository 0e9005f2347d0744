"""rng-under-ep as upstream would write it: what patches/rng-under-ep/<release>.patch carries.

The edits mirror the monkeypatch (``runtime/core.py``, ``runtime/old_layouts.py``) in effect:

* ``get_rng_state`` describes the torch_dist RNG state per rank: global shape
  ``(pp_size, tp_size, dp_cp_size)``, offset ``(pp_rank, tp_rank, dp_cp_rank)``, ``replica_id=0``;
* ``_load_global_dist_base_checkpoint`` asks for the RNG shard in the layout the checkpoint has
  (``_align_rng_state_request`` below, the source twin of ``runtime/old_layouts.py``'s
  ``align_rng_request``):
  the per-rank layout (also after a data-parallel resize), or the old 2-D ``(pp, tp)`` one with a
  warning; a rank the checkpoint has no state for keeps its own, with a warning.

tests/patches/test_source_patches.py checks that the patched source satisfies the fix's probe and
round-trips with the monkeypatch off, and that ``python tools/patchgen rng-under-ep SRC_ROOT RELEASE``
regenerates the committed diff (SRC_ROOT holds the unpacked wheel: SRC_ROOT/megatron/training/...).

Nothing is imported from torch or Megatron: the replacement function below is never called here; it
runs where the diff puts it, in ``megatron/training/checkpointing.py``, whose globals
(``ShardedObject``) it uses.
"""

from __future__ import annotations

import sys

from ....sourcediff import PatchgenError, Replace, insert_before, replacement_section

PATH = "megatron/training/checkpointing.py"


# -- replacement ---------------------------------------------------------------------------------
# Inserted before ``_load_global_dist_base_checkpoint``, verbatim (from the next definition to the
# end marker): the load side of the source fix.

def _align_rng_state_request(sharded_state_dict, checkpoint_name):
    """Ask for the torch_dist RNG state in the layout the checkpoint has.

    get_rng_state describes it per rank, (pp, tp, dp_cp). A checkpoint written before that holds one
    copy per (pp, tp) (the old 2-D layout): that copy is the best state there is, loaded with a
    warning. A rank whose dp_cp index the checkpoint lacks (saved with a smaller data-parallel size)
    keeps its current state, with a warning; after a data-parallel shrink every rank does (a
    ShardedObject loads only whole: every stored shard requested by some rank).
    Returns (sharded_state_dict to load, RNG state to put back after loading or None).
    """
    import warnings
    from dataclasses import replace

    from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader

    request = sharded_state_dict.get('rng_state') if isinstance(sharded_state_dict, dict) else None
    if not isinstance(request, ShardedObject) or len(request.global_shape) != 3:
        return sharded_state_dict, None
    prefix = f'{request.key}/shard_'
    stored = []
    for name in _get_filesystem_reader(checkpoint_name).read_metadata().state_dict_metadata:
        if name.startswith(prefix):
            offset, _, shape = name[len(prefix):].partition('_')
            stored.append((tuple(map(int, offset.split('.'))), tuple(map(int, shape.split('.')))))
    pp_tp_shape, pp_tp_offset = request.global_shape[:2], request.global_offset[:2]
    dp_cp_rank = request.global_offset[2]
    where = f'(pp {pp_tp_offset[0]}, tp {pp_tp_offset[1]}, dp_cp {dp_cp_rank})'
    per_rank = [s for o, s in stored if len(s) == 3 and s[:2] == pp_tp_shape and o[:2] == pp_tp_offset]
    if per_rank:
        stored_dp_cp = per_rank[0][2]
        if stored_dp_cp == request.global_shape[2]:
            return sharded_state_dict, None
        sharded_state_dict = dict(sharded_state_dict)
        if stored_dp_cp > request.global_shape[2]:
            warnings.warn(
                f'{checkpoint_name} holds RNG states for {stored_dp_cp} dp_cp ranks (saved with a larger '
                f'data-parallel size than this run\'s {request.global_shape[2]}); this rank {where} keeps '
                f'its current RNG state'
            )
            del sharded_state_dict['rng_state']
            return sharded_state_dict, request.data
        if dp_cp_rank < stored_dp_cp:
            sharded_state_dict['rng_state'] = replace(request, global_shape=(*pp_tp_shape, stored_dp_cp))
            return sharded_state_dict, None
        warnings.warn(
            f'{checkpoint_name} holds RNG states for dp_cp ranks 0..{stored_dp_cp - 1} only (saved with '
            f'a smaller data-parallel size); this rank {where} keeps its current RNG state'
        )
        del sharded_state_dict['rng_state']
        return sharded_state_dict, request.data
    if (pp_tp_offset, pp_tp_shape) in stored:
        warnings.warn(
            f'{checkpoint_name} stores the RNG state in the old 2-D (pp, tp) layout (one copy per '
            f'(pp, tp), written by a single data-parallel rank); this rank {where} restores that copy, '
            f'which is another rank\'s state unless it was saved by this rank or with '
            f'--data-parallel-random-init; the next save writes every rank\'s own state'
        )
        sharded_state_dict = dict(sharded_state_dict)
        sharded_state_dict['rng_state'] = replace(
            request, global_shape=pp_tp_shape, global_offset=pp_tp_offset, replica_id=dp_cp_rank
        )
    return sharded_state_dict, None


# -- end of replacement ---------------------------------------------------------------------------


# -- save side: get_rng_state -----------------------------------------------------------------------

# 0.17 / 0.18: one ShardedObject call, the replica id read from parallel_state.
_SAVE_017_OLD = (
    "        rng_state_list = ShardedObject('rng_state', rng_state_list, (pp_size, tp_size), (pp_rank, tp_rank),\n"
    "                                       replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))\n"
)
_SAVE_017_NEW = (
    "        # One shard per rank: the data-parallel ranks of a (pp, tp) are not replicas (the expert-parallel\n"
    "        # RNG stream is seeded per EP rank), so each of them writes and restores its own state.\n"
    "        dp_cp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)\n"
    "        dp_cp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)\n"
    "        rng_state_list = ShardedObject('rng_state', rng_state_list, (pp_size, tp_size, dp_cp_size),\n"
    "                                       (pp_rank, tp_rank, dp_cp_rank), replica_id=0)\n"
)

# 0.19: the groups may be passed in (dp_cp_rank is computed above the branch; its size is not).
_SAVE_019_SIZE_OLD = (
    "    if ckpt_format == 'torch_dist':\n"
    "        pp_rank = get_pg_rank(pp_group)\n"
)
_SAVE_019_SIZE_NEW = (
    "    if ckpt_format == 'torch_dist':\n"
    "        # One shard per rank: the data-parallel ranks of a (pp, tp) are not replicas (the expert-parallel\n"
    "        # RNG stream is seeded per EP rank), so each of them writes and restores its own state.\n"
    "        dp_cp_size = (\n"
    "            get_pg_size(dp_cp_group)\n"
    "            if dp_cp_group is not None\n"
    "            else mpu.get_data_parallel_world_size(with_context_parallel=True)\n"
    "        )\n"
    "        pp_rank = get_pg_rank(pp_group)\n"
)
_SAVE_019_OLD = (
    "            (pp_size, tp_size),\n"
    "            (pp_rank, tp_rank),\n"
    "            replica_id=dp_cp_rank,\n"
    "        )\n"
)
_SAVE_019_NEW = (
    "            (pp_size, tp_size, dp_cp_size),\n"
    "            (pp_rank, tp_rank, dp_cp_rank),\n"
    "            replica_id=0,\n"
    "        )\n"
)


# -- load side: _load_global_dist_base_checkpoint ----------------------------------------------------


def _load_edits():
    """The helper above goes before the loader, which calls it and puts a kept RNG state back."""
    helper = replacement_section(sys.modules[__name__])
    return [
        insert_before(PATH, "def _load_global_dist_base_checkpoint(\n", helper),
        Replace(
            PATH,
            "    checkpoint_name = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)\n"
            "    load_strategy = TorchDistLoadShardedStrategy(",
            "    checkpoint_name = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)\n"
            "    sharded_state_dict, kept_rng_state = _align_rng_state_request(sharded_state_dict, checkpoint_name)\n"
            "    load_strategy = TorchDistLoadShardedStrategy(",
        ),
        Replace(
            PATH,
            "\n    )\n    return state_dict, checkpoint_name, release, CheckpointType.GLOBAL\n",
            "\n    )\n"
            "    if kept_rng_state is not None:\n"
            "        state_dict['rng_state'] = kept_rng_state\n"
            "    return state_dict, checkpoint_name, release, CheckpointType.GLOBAL\n",
        ),
    ]


def source_edits(release: str) -> list:
    """The edits for ``release`` (0.17, 0.18 and 0.19 lines), in the order they are applied."""
    series = ".".join(release.split(".")[:2])
    if series in ("0.17", "0.18"):
        save = [Replace(PATH, _SAVE_017_OLD, _SAVE_017_NEW)]
    elif series == "0.19":
        save = [Replace(PATH, _SAVE_019_SIZE_OLD, _SAVE_019_SIZE_NEW), Replace(PATH, _SAVE_019_OLD, _SAVE_019_NEW)]
    else:
        raise PatchgenError(f"rng-under-ep has no edits for {release} (affected: 0.17, 0.18, 0.19)")
    return save + _load_edits()
