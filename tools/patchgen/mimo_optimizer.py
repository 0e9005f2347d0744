"""Write patches/mimo-optimizer/<release>.patch from pristine Megatron-Core sources.

The edits mirror mcore_ckpt_fixes/fixes/mimo_optimizer.py (the monkeypatch) in effect: the saved
layout becomes the one Megatron-Core 0.19 writes (per-module ShardedObjects for param groups,
sharding type and grad scaler, replica id (tp, pp, dp), inner keys prefixed ``mimo.<module>.``), and
the load tolerates the emptied ``optimizer`` sub-dict not coming back. 0.18 already has all but the
prefix. tests/patches/test_source_patches.py checks that the patched source satisfies the fix's
probe and round-trips with the monkeypatch off.

    python tools/patchgen/mimo_optimizer.py SRC_ROOT RELEASE > patches/mimo-optimizer/RELEASE.patch
SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

import sys

from _diff import write_diff

PATH = "megatron/core/models/mimo/optimizer.py"

# (releases the edit applies to, anchor, replacement)
EDITS = [
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


def patch_text(text: str, release: str) -> str:
    series = ".".join(release.split(".")[:2])
    for releases, old, new in EDITS:
        if series not in releases:
            continue
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"patchgen: anchor found {count} times (need 1) in {release}: {old!r}")
        text = text.replace(old, new)
    return text


def main(src_root: str, release: str) -> None:
    write_diff(src_root, PATH, lambda text: patch_text(text, release))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
