"""mimo-optimizer as upstream would write it: what patches/mimo-optimizer/<release>.patch carries.

The edits mirror the monkeypatch (``runtime/``: ``core.py``, ``common_state.py``, ``old_layouts.py``) in
effect: the saved layout becomes the one Megatron-Core 0.19 writes (per-module ShardedObjects for
param groups, sharding type and grad scaler, replica id (tp, pp, dp), inner keys prefixed
``mimo.<module>.``), and the load tolerates the emptied ``optimizer`` sub-dict not coming back. 0.18
already has all but the prefix. On 0.17, 0.18 and 0.19 each module's common state also travels in
its own object: the marked replacement section of ``runtime/common_state.py`` is copied verbatim to the end
of optimizer.py and called where MimoOptimizer saves and loads each module.
On every affected release (0.17, 0.18, 0.19) ``dist_checkpointing.load`` (serialization.py) also
reads what unfixed 0.17/0.18 wrote: the marked replacement section of ``runtime/old_layouts.py`` is copied
verbatim to the end of serialization.py and called before and after the load, as the monkeypatch's
wrapper does (the warning is a plain UserWarning there: the package is not imported).
tests/patches/test_source_patches.py checks that the patched source satisfies the fix's probe and
round-trips with the monkeypatch off, and that ``python tools/patchgen mimo-optimizer SRC_ROOT
RELEASE`` regenerates the committed diff (SRC_ROOT holds the unpacked wheel: SRC_ROOT/megatron/core/...).

Nothing is imported from torch or Megatron here (the two runtime modules it reads import neither at module level).
"""

from __future__ import annotations

from ....sourcediff import Replace, Transform, refuse_names, replacement_section
from ..runtime import common_state, old_layouts

PATH = "megatron/core/models/mimo/optimizer.py"
LOAD_PATH = "megatron/core/dist_checkpointing/serialization.py"

# -- MimoOptimizer (optimizer.py): (releases the edit applies to, anchor, replacement) --------------

OPTIMIZER_EDITS = [
    (
        ("0.17", "0.18"),
        "from megatron.core.dist_checkpointing.mapping import ShardedObject\n",
        "from megatron.core.dist_checkpointing.mapping import ShardedObject\n"
        "from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding\n",
    ),
    (
        ("0.17",),
        "                _restore_param_groups(sub_sd, inner_opt, name)\n",
        "                _restore_param_groups(sub_sd, inner_opt, name)\n"
        "                _restore_param_state_sharding_type(sub_sd)\n",
    ),
    (
        ("0.17",),
        "                    _extract_grad_scaler(sub_sd, name, suffix, replica_id)\n",
        "                    _extract_param_state_sharding_type(sub_sd, name, suffix, replica_id)\n"
        "                    _extract_grad_scaler(sub_sd, name, suffix, replica_id)\n",
    ),
    (
        ("0.17", "0.18"),
        "                    _extract_grad_scaler(sub_sd, name, suffix, replica_id)\n\n"
        "                sharded_state[name] = module_sd\n",
        "                    _extract_grad_scaler(sub_sd, name, suffix, replica_id)\n\n"
        "                # Inner keys follow the module's own parallel layout (dp_group_idx_0 in every\n"
        "                # module): the module name keeps two modules' objects apart.\n"
        "                add_prefix_for_sharding(module_sd, f'mimo.{name}.')\n"
        "                sharded_state[name] = module_sd\n",
    ),
    (
        ("0.17",),
        "        del opt_sub['param_groups']\n",
        "        del opt_sub['param_groups']\n"
        "        if not opt_sub:\n"
        "            # An empty dict would be common state, written by global rank 0 only.\n"
        "            del sub_sd['optimizer']\n",
    ),
    (
        ("0.17",),
        "    sub_sd['optimizer']['param_groups'] = loaded_pg\n",
        "    # The emptied 'optimizer' sub-dict is not saved (see _extract_param_groups).\n"
        "    sub_sd.setdefault('optimizer', {})['param_groups'] = loaded_pg\n\n\n"
        "def _extract_param_state_sharding_type(sub_sd, module_name, suffix, replica_id):\n"
        "    \"\"\"Save: keep the sharding type with its module (common state is rank 0's only).\"\"\"\n"
        "    if 'param_state_sharding_type' in sub_sd:\n"
        "        sub_sd[f'_mimo_param_state_sharding_type{suffix}'] = ShardedObject(\n"
        "            f'optimizer.mimo.{module_name}{suffix}.param_state_sharding_type',\n"
        "            sub_sd.pop('param_state_sharding_type'),\n"
        "            (1,),\n"
        "            (0,),\n"
        "            replica_id=replica_id,\n"
        "        )\n\n\n"
        "def _restore_param_state_sharding_type(sub_sd):\n"
        "    \"\"\"Load: put the sharding type back where DistributedOptimizer looks for it.\"\"\"\n"
        "    for k in list(sub_sd.keys()):\n"
        "        if k.startswith('_mimo_param_state_sharding_type'):\n"
        "            sub_sd['param_state_sharding_type'] = sub_sd.pop(k)\n"
        "            break\n",
    ),
    (
        ("0.17",),
        "    return (0, pg_collection.pp.rank(), pg_collection.dp.rank())\n",
        "    assert (\n"
        "        hasattr(pg_collection, 'tp') and pg_collection.tp is not None\n"
        "    ), \"pg_collection.tp must be set for checkpoint deduplication\"\n"
        "    # Every TP rank holds the same metadata: only TP rank 0 is the main replica.\n"
        "    return (pg_collection.tp.rank(), pg_collection.pp.rank(), pg_collection.dp.rank())\n",
    ),
]

# Defect (e), every release: each module's common state in its own object (common_state.py's
# replacement section, appended to optimizer.py). Applied after the edits above (same anchors).
OPTIMIZER_EDITS += [
    (
        ("0.17", "0.18", "0.19"),
        "            for sub_sd, inner_opt in _iter_optimizer_sub_dicts(module_sd, info.optimizer):\n",
        "            for sub_sd, inner_opt in _iter_optimizer_sub_dicts(module_sd, info.optimizer):\n"
        "                _restore_common_state(sub_sd)\n",
    ),
    (
        ("0.17", "0.18", "0.19"),
        "                    _extract_grad_scaler(sub_sd, name, suffix, replica_id)\n",
        "                    _extract_grad_scaler(sub_sd, name, suffix, replica_id)\n"
        "                    # Last: what is still plain is the module's common state, which\n"
        "                    # dist_checkpointing writes from global rank 0 only (another module's).\n"
        "                    _extract_common_state(sub_sd, name, suffix, replica_id)\n",
    ),
]
_COMMON_HEADER = "\n\n# Each module's common state (plain values) saved with the module (see sharded_state_dict).\n"


def _append_common_state(text: str) -> str:
    code = refuse_names(replacement_section(common_state), _FIX_ONLY_NAMES)
    return text.rstrip("\n") + "\n" + _COMMON_HEADER + code.rstrip("\n") + "\n"


# -- dist_checkpointing.load (serialization.py): reads the layout unfixed 0.17/0.18 wrote -----------

# In load() only: the other entry points do not verify integrity.
_LOAD_START = (
    "    if verify_integrity:\n        verify_integrity_manifest(checkpoint_dir)\n"
    "    if sharded_strategy is None:\n        sharded_strategy = TorchDistLoadShardedStrategy()\n"
)
_LOAD_END = "    if StrictHandling.requires_returning_mismatch_keys(strict):\n"
_SECTION_HEADER = "\n\n# Reading the MIMO optimizer layout of unfixed Megatron-Core 0.17/0.18 (see load()).\n"
# Names that exist only in the fix package: the copied section must not need them.
_FIX_ONLY_NAMES = ("MODULE", "LOAD_MODULE", "ID", "mark", "original", "MegatronPatchWarning")


def _append_section(text: str) -> str:
    code = refuse_names(replacement_section(old_layouts), _FIX_ONLY_NAMES)
    return text.rstrip("\n") + "\n" + _SECTION_HEADER + code.rstrip("\n") + "\n"


def _load_edits() -> list:
    return [
        Replace(LOAD_PATH, "import logging\n", "import logging\nimport warnings\n"),
        Replace(
            LOAD_PATH,
            _LOAD_START,
            "    # MIMO optimizer state an unfixed Megatron-Core 0.17/0.18 wrote (keys without the\n"
            "    # 'mimo.<module>.' prefix) is read from its old keys, with a warning.\n"
            "    sharded_state_dict, finish_mimo_load = align_mimo_optimizer_request(\n"
            "        sharded_state_dict, checkpoint_dir\n"
            "    )\n" + _LOAD_START,
        ),
        Replace(
            LOAD_PATH,
            _LOAD_END,
            "    for mimo_warning in finish_mimo_load(common_state_dict):\n"
            "        warnings.warn(mimo_warning)\n" + _LOAD_END,
        ),
        Transform(LOAD_PATH, _append_section),
    ]


def source_edits(release: str) -> list:
    """The edits for ``release``: MimoOptimizer's (the layout on 0.17/0.18, each module's common state
    on every affected line) and the load side on every affected line."""
    series = ".".join(release.split(".")[:2])
    optimizer = [Replace(PATH, old, new) for releases, old, new in OPTIMIZER_EDITS if series in releases]
    return optimizer + [Transform(PATH, _append_common_state)] + _load_edits()
