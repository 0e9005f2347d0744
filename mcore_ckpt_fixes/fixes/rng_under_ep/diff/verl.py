"""rng-under-ep in verl as verl would write it: what patches/rng-under-ep/verl-<version>.patch carries.

The edits to ``verl/utils/checkpoint/megatron_checkpoint_manager.py`` mirror the monkeypatch
(``runtime/verl.py``):

* ``MegatronCheckpointManager.get_rng_state``: torch_dist per rank (global shape ``(pp, tp, dp_cp)``,
  offset ``(pp_rank, tp_rank, dp_cp_rank)``, ``replica_id=0``); Megatron-FSDP, this rank's own entry
  ``"(pp, tp, dp_cp)"`` (a copy) beside the shared ``"(pp, tp)"`` one;
* ``load_checkpoint``: the ``extra/dist_ckpt`` RNG shard asked for in the layout the checkpoint has,
  by Megatron-Core's own source fix's helper ``_align_rng_state_request`` (the replacement section of
  :mod:`.core`, verbatim), the old 2-D layout with a warning;
* ``_load_megatron_fsdp_checkpoint``: asks for the own entry only where the checkpoint's metadata has
  it; ``load_rng_states`` restores it, else the shared copy with a warning.

Generated with ``python tools/patchgen rng-under-ep SRC_ROOT verl-0.9.1`` (SRC_ROOT: the unpacked
verl wheel). Nothing is imported from torch, Megatron or verl here.
"""

from __future__ import annotations

import sys

from ....sourcediff import PatchgenError, Replace, insert_before, replacement_section
from . import core as upstream

PATH = "verl/utils/checkpoint/megatron_checkpoint_manager.py"


# -- replacement ---------------------------------------------------------------------------------
# Inserted before ``class MegatronCheckpointManager``, verbatim (with core.py's helper before it).

def _drop_absent_rng_entry(sharded_state_dict, checkpoint_dir):
    """Megatron-FSDP load: ask for this rank's own RNG entry only where the checkpoint holds one
    (saved before every rank saved its own, it holds the shared "(pp, tp)" copy only; a partial
    load would silently keep the template's state for the missing entry)."""
    import torch.distributed.checkpoint as dcp

    rng = sharded_state_dict.get("rng_state")
    own = [k for k in rng if isinstance(k, str) and k.count(",") == 2] if isinstance(rng, dict) else []
    if len(own) != 1:
        return
    prefix = f"rng_state.{own[0]}"
    stored = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    if not any(k == prefix or k.startswith(prefix + ".") for k in stored):
        del rng[own[0]]


# -- end of replacement ---------------------------------------------------------------------------


_CLASS = "class MegatronCheckpointManager(BaseCheckpointManager):\n"

_FSDP_SAVE_OLD = '            return {f"({pp_rank}, {tp_rank})": rng_state_list}\n'
_FSDP_SAVE_NEW = (
    "            dp_cp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)\n"
    "            # Every rank also keeps its own entry: the data-parallel ranks of a (pp, tp) are not\n"
    "            # replicas (the expert-parallel RNG stream is seeded per EP rank). The shared entry stays\n"
    "            # for readers that know only it.\n"
    "            import copy\n"
    "\n"
    "            return {\n"
    '                f"({pp_rank}, {tp_rank})": rng_state_list,\n'
    '                f"({pp_rank}, {tp_rank}, {dp_cp_rank})": copy.deepcopy(rng_state_list),\n'
    "            }\n"
)

_DIST_SAVE_OLD = (
    "            rng_state_list = ShardedObject(\n"
    '                "rng_state",\n'
    "                rng_state_list,\n"
    "                (pp_size, tp_size),\n"
    "                (pp_rank, tp_rank),\n"
    "                replica_id=mpu.get_data_parallel_rank(with_context_parallel=True),\n"
    "            )\n"
)
_DIST_SAVE_NEW = (
    "            # One shard per rank: the data-parallel ranks of a (pp, tp) are not replicas (the\n"
    "            # expert-parallel RNG stream is seeded per EP rank), so each writes and restores its own.\n"
    "            dp_cp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)\n"
    "            dp_cp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)\n"
    "            rng_state_list = ShardedObject(\n"
    '                "rng_state",\n'
    "                rng_state_list,\n"
    "                (pp_size, tp_size, dp_cp_size),\n"
    "                (pp_rank, tp_rank, dp_cp_rank),\n"
    "                replica_id=0,\n"
    "            )\n"
)

_FSDP_TEMPLATE_OLD = "        sharded_state_dict.update(self._build_extra_state_dict())\n"
_FSDP_TEMPLATE_NEW = (
    "        sharded_state_dict.update(self._build_extra_state_dict())\n"
    "        _drop_absent_rng_entry(sharded_state_dict, dist_checkpoint_path)\n"
)

_FSDP_LOAD_OLD = (
    '            key = f"({pp_rank}, {tp_rank})"\n'
    "            if key in rng_states:\n"
    "                rng_states = rng_states[key]\n"
)
_FSDP_LOAD_NEW = (
    '            key = f"({pp_rank}, {tp_rank})"\n'
    '            own_key = f"({pp_rank}, {tp_rank}, {mpu.get_data_parallel_rank(with_context_parallel=True)})"\n'
    "            if own_key in rng_states:\n"
    "                rng_states = rng_states[own_key]\n"
    "            elif key in rng_states:\n"
    "                import warnings\n"
    "\n"
    "                warnings.warn(\n"
    '                    f"This Megatron-FSDP checkpoint has no RNG state of its own for this rank {own_key} (pp, "\n'
    '                    "tp, dp_cp): it stores the old layout (one shared copy per (pp, tp), its parts written "\n'
    '                    "by different data-parallel ranks) or was saved with a smaller data-parallel size; this "\n'
    '                    "rank restores that shared copy; the next save writes every rank\'s own state"\n'
    "                )\n"
    "                rng_states = rng_states[key]\n"
)

_DIST_LOAD_OLD = (
    "            extra_sd = self._build_extra_state_dict()\n"
    "            loaded_extra = load_dist_checkpointing(\n"
    "                sharded_state_dict=extra_sd,\n"
    "                ckpt_dir=extra_dist_path,\n"
    "            )\n"
)
_DIST_LOAD_NEW = (
    "            extra_sd = self._build_extra_state_dict()\n"
    "            extra_sd, kept_rng_state = _align_rng_state_request(extra_sd, extra_dist_path)\n"
    "            loaded_extra = load_dist_checkpointing(\n"
    "                sharded_state_dict=extra_sd,\n"
    "                ckpt_dir=extra_dist_path,\n"
    "            )\n"
    "            if kept_rng_state is not None:\n"
    '                loaded_extra["rng_state"] = kept_rng_state\n'
)


def source_edits(version: str) -> list:
    """The edits for verl ``version`` (0.9.1 measured; the anchors name what they need)."""
    if version != "0.9.1":
        raise PatchgenError(f"rng-under-ep has verl edits for 0.9.1 only, not {version}")
    sections = (replacement_section(upstream), replacement_section(sys.modules[__name__]))
    helpers = "".join(section.rstrip() + "\n\n\n" for section in sections)
    return [
        insert_before(PATH, _CLASS, helpers),
        Replace(PATH, _FSDP_SAVE_OLD, _FSDP_SAVE_NEW),
        Replace(PATH, _DIST_SAVE_OLD, _DIST_SAVE_NEW),
        Replace(PATH, _FSDP_TEMPLATE_OLD, _FSDP_TEMPLATE_NEW),
        Replace(PATH, _FSDP_LOAD_OLD, _FSDP_LOAD_NEW),
        Replace(PATH, _DIST_LOAD_OLD, _DIST_LOAD_NEW),
    ]
