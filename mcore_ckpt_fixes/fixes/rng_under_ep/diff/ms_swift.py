"""rng-under-ep in ms-swift as upstream would write it: what patches/rng-under-ep/ms-swift-<version>.patch
carries, against ``swift/megatron/utils/megatron_lm_utils.py`` of the released wheel.

The edits mirror the monkeypatch (``runtime/ms_swift.py``) for ``torch_dist`` (the fsdp_dtensor entry is
left as ms-swift writes it, as in the Megatron-LM diffs):

* ``_get_rng_state`` describes the RNG state per rank: global shape ``(pp, tp, dp_cp)``, offset
  ``(pp_rank, tp_rank, dp_cp_rank)``, ``replica_id=0``;
* ``load_mcore_checkpoint`` asks for the RNG shard in the layout the checkpoint has, through
  ``_align_rng_state_request``, the same helper the Megatron-LM diff inserts (:mod:`.core`,
  copied verbatim): per-rank, or the old 2-D layout with a warning; a rank the checkpoint has no
  state for keeps its own.

Nothing is imported from torch, Megatron or ms-swift here.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, Replace, insert_before, replacement_section
from . import core as upstream

PATH = "swift/megatron/utils/megatron_lm_utils.py"

_SAVE_OLD = (
    "    rng_state_list = ShardedObject(\n"
    "        'rng_state',\n"
    "        rng_state_list, (pp_size, tp_size), (pp_rank, tp_rank),\n"
    "        replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))\n"
)
_SAVE_NEW = (
    "    # One shard per rank: the data-parallel ranks of a (pp, tp) are not replicas (the expert-parallel\n"
    "    # RNG stream is seeded per EP rank), so each of them writes and restores its own state.\n"
    "    dp_cp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)\n"
    "    dp_cp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)\n"
    "    rng_state_list = ShardedObject(\n"
    "        'rng_state', rng_state_list, (pp_size, tp_size, dp_cp_size), (pp_rank, tp_rank, dp_cp_rank), replica_id=0)\n"
)

_LOAD_OLD = "        state_dict = dist_checkpointing.load(sharded_state_dict, checkpoint_dir, load_strategy)\n"
_LOAD_NEW = (
    "        sharded_state_dict, kept_rng_state = _align_rng_state_request(sharded_state_dict, checkpoint_dir)\n"
    "        state_dict = dist_checkpointing.load(sharded_state_dict, checkpoint_dir, load_strategy)\n"
    "        if kept_rng_state is not None:\n"
    "            state_dict['rng_state'] = kept_rng_state\n"
)


def source_edits(version: str) -> list:
    """The edits for ms-swift ``version`` (4.6.x), in the order they are applied."""
    if not version.startswith("4.6."):
        raise PatchgenError(f"rng-under-ep has no ms-swift edits for {version} (written against 4.6.0)")
    helper = replacement_section(upstream)
    return [
        Replace(PATH, _SAVE_OLD, _SAVE_NEW),
        insert_before(PATH, "def load_mcore_checkpoint(", helper),
        Replace(PATH, _LOAD_OLD, _LOAD_NEW),
    ]
