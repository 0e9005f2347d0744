"""rng-under-ep in Megatron-Bridge as upstream would write it: patches/rng-under-ep/megatron-bridge-<version>.patch.

The edits mirror the monkeypatch (``runtime/bridge.py``) in effect, on ``fsdp_dtensor`` only (Bridge's
torch_dist RNG state is per rank under EP already):

* ``get_rng_state`` writes every rank's own entry ``"(pp, tp, dp_cp)"`` beside the ``"(pp, tp)"``
  one (kept, so that older releases read the checkpoint as before);
* ``load_fsdp_dtensor_checkpoint`` reads the checkpoint's DCP metadata once (it did in non-strict
  mode already) and leaves this rank's own entry out of the request where the checkpoint has none
  (``_drop_absent_rng_state_entries`` below);
* ``load_checkpoint`` restores this rank's own entry, or the ``"(pp, tp)"`` one with a warning that
  names the old layout.

Nothing is imported from torch or Megatron here: the replacement function below runs where the
diff puts it, in ``megatron/bridge/training/checkpointing.py``, whose ``Any`` its annotations name.
"""

from __future__ import annotations

import sys

from ....sourcediff import PatchgenError, Replace, insert_after, insert_before, replacement_section

PATH = "megatron/bridge/training/checkpointing.py"


# -- replacement ---------------------------------------------------------------------------------
# Inserted before ``load_fsdp_dtensor_checkpoint``, verbatim (from the next definition to the end
# marker).

def _drop_absent_rng_state_entries(state_dict: dict[str, Any], state_dict_metadata: dict[str, Any]) -> None:
    """Leave this rank's own fsdp_dtensor RNG entry ("(pp, tp, dp)") out of a load where the
    checkpoint does not hold it (written before every rank saved its own, or with a smaller
    data-parallel size): load_checkpoint then restores the "(pp, tp)" entry, with a warning.

    Also needed when partial loads are allowed: DCP would skip the missing entry and leave this
    rank's current state in its place, to be restored as if it had been loaded.
    """
    rng_state = state_dict.get("rng_state")
    if not isinstance(rng_state, dict):
        return
    for key in [k for k in rng_state if isinstance(k, str) and k.count(",") == 2]:
        prefix = f"rng_state.{key}"
        if not any(name == prefix or name.startswith(prefix + ".") for name in state_dict_metadata):
            del rng_state[key]


# -- end of replacement ---------------------------------------------------------------------------


_SAVE_OLD = (
    '    elif ckpt_format == "fsdp_dtensor":\n'
    "        pp_rank = pg_collection.pp.rank()\n"
    "        tp_rank = pg_collection.tp.rank()\n"
    '        rng_state_list = {f"({pp_rank}, {tp_rank})": rng_state_list}\n'
)
_SAVE_NEW = (
    '    elif ckpt_format == "fsdp_dtensor":\n'
    "        pp_rank = pg_collection.pp.rank()\n"
    "        tp_rank = pg_collection.tp.rank()\n"
    "        dp_rank = pg_collection.dp_cp.rank()\n"
    "        # Every data-parallel rank writes its own entry: the data-parallel ranks of a (pp, tp) are\n"
    "        # not replicas (the expert-parallel RNG stream is seeded per EP rank), and DCP keeps one\n"
    "        # copy of a key that several ranks write. The (pp, tp) entry stays for older releases.\n"
    "        rng_state_list = {\n"
    '            f"({pp_rank}, {tp_rank})": rng_state_list,\n'
    '            f"({pp_rank}, {tp_rank}, {dp_rank})": copy.deepcopy(rng_state_list),\n'
    "        }\n"
)

_LOAD_OLD = (
    '    allow_partial_load = not getattr(ckpt_cfg, "strict_fsdp_dtensor_load", False)\n'
    "    if allow_partial_load:\n"
    "        state_dict_metadata = fs_storage_reader.read_metadata().state_dict_metadata\n"
)
_LOAD_NEW = (
    '    allow_partial_load = not getattr(ckpt_cfg, "strict_fsdp_dtensor_load", False)\n'
    "    state_dict_metadata = fs_storage_reader.read_metadata().state_dict_metadata\n"
    "    _drop_absent_rng_state_entries(state_dict, state_dict_metadata)\n"
    "    if allow_partial_load:\n"
)

_RESTORE_OLD = (
    "                    # FSDP DTensor format: {(pp_rank, tp_rank): rng_state_list}\n"
    "                    tp_rank = pg_collection.tp.rank()\n"
    "                    pp_rank = pg_collection.pp.rank()\n"
    '                    key = f"({pp_rank}, {tp_rank})"\n'
    '                    if key in state_dict["rng_state"]:\n'
    '                        rng_state_list = state_dict["rng_state"][key]\n'
)
_RESTORE_NEW = (
    "                    # FSDP DTensor format: {(pp_rank, tp_rank, dp_rank): rng_state_list} beside\n"
    "                    # {(pp_rank, tp_rank): rng_state_list}, which older checkpoints hold alone\n"
    "                    tp_rank = pg_collection.tp.rank()\n"
    "                    pp_rank = pg_collection.pp.rank()\n"
    "                    dp_rank = pg_collection.dp_cp.rank()\n"
    '                    own_key = f"({pp_rank}, {tp_rank}, {dp_rank})"\n'
    '                    key = f"({pp_rank}, {tp_rank})"\n'
    '                    if own_key in state_dict["rng_state"]:\n'
    '                        rng_state_list = state_dict["rng_state"][own_key]\n'
    '                    elif key in state_dict["rng_state"]:\n'
    "                        warnings.warn(\n"
    '                            f"{checkpoint_name} has no fsdp_dtensor RNG state of its own for this rank "\n'
    '                            f"(pp {pp_rank}, tp {tp_rank}, dp_cp {dp_rank}): it was written before every rank "\n'
    '                            "saved its own (the old layout: one shared copy per (pp, tp), its parts written "\n'
    '                            "by different data-parallel ranks) or with a smaller data-parallel size; this "\n'
    '                            "rank restores that shared copy; the next save writes every rank\'s own state"\n'
    "                        )\n"
    '                        rng_state_list = state_dict["rng_state"][key]\n'
)


def source_edits(version: str) -> list:
    """The edits for Megatron-Bridge ``version`` ("0.6.2" or "megatron-bridge-0.6.2")."""
    version = version.removeprefix("megatron-bridge-")
    if version != "0.6.2":
        raise PatchgenError(f"rng-under-ep has no Megatron-Bridge edits for {version} (written for 0.6.2)")
    helper = replacement_section(sys.modules[__name__])
    return [
        insert_after(PATH, "import contextlib\n", "import copy\n"),
        insert_after(PATH, "import threading\n", "import warnings\n"),
        Replace(PATH, _SAVE_OLD, _SAVE_NEW),
        Replace(PATH, _RESTORE_OLD, _RESTORE_NEW),
        insert_before(PATH, "def load_fsdp_dtensor_checkpoint(\n", helper),
        Replace(PATH, _LOAD_OLD, _LOAD_NEW),
    ]
