"""Write patches/tp-group/<release>.patch from pristine Megatron-Core sources.

The edits mirror mcore_ckpt_fixes/fixes/tp_group.py (the monkeypatch) line for line in effect;
tests/patches/test_source_patches.py checks that the patched source satisfies every probe of that
fix and round-trips with the monkeypatch off, so the two cannot drift apart silently.

    python tools/patchgen/tp_group.py SRC_ROOT RELEASE > patches/tp-group/RELEASE.patch
SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

import sys

from _diff import write_diff

FILES = {
    "megatron/core/ssm/mamba_layer.py": [
        (
            '        assert pg_collection is not None, "pg_collection must be provided for MambaLayer"\n',
            '        assert pg_collection is not None, "pg_collection must be provided for MambaLayer"\n'
            "        # Keep the TP group: sharded_state_dict must not fall back to parallel_state.\n"
            "        self.tp_group = pg_collection.tp\n",
        ),
    ],
    "megatron/core/ssm/mamba_mixer.py": [
        (
            '            setattr(self.norm.weight, "tensor_model_parallel", True)\n',
            '            setattr(self.norm.weight, "tensor_model_parallel", True)\n'
            "            # ExtendedRMSNorm.sharded_state_dict would otherwise ask parallel_state.\n"
            "            self.norm.tp_group = self.pg_collection.tp\n",
        ),
        (
            "            sharded_offsets=sharded_offsets,\n        )\n        # Submodules\n",
            "            sharded_offsets=sharded_offsets,\n"
            "            tp_group=self.tp_group,\n"
            "            dp_cp_group=metadata['dp_cp_group'],\n"
            "        )\n        # Submodules\n",
        ),
    ],
    "megatron/core/models/vision/radio.py": [
        (
            "init_method=lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=1.0),\n",
            "init_method=lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=1.0),\n"
            "{indent}# Shard the patch embedder over the model's own TP group when one is given.\n"
            "{indent}tp_group=pg_collection.tp if pg_collection is not None else None,\n",
        ),
        (
            "        self.pg_collection = pg_collection\n",
            "        self.pg_collection = pg_collection\n"
            "        if pg_collection is not None:\n"
            "            # Keep the TP group: sharded_state_dict must not fall back to parallel_state.\n"
            "            self.tp_group = pg_collection.tp\n",
        ),
    ],
}


def patch_text(text: str, edits) -> str:
    for old, new in edits:
        count = text.count(old)
        if count == 0:
            raise SystemExit(f"patchgen: anchor not found: {old!r}")
        if "{indent}" in new:
            out, pos = [], 0
            while True:
                at = text.find(old, pos)
                if at < 0:
                    out.append(text[pos:])
                    break
                line_start = text.rfind("\n", 0, at) + 1
                indent = text[line_start:at]
                out.append(text[pos:at] + new.replace("{indent}", indent))
                pos = at + len(old)
            text = "".join(out)
        else:
            if count != 1:
                raise SystemExit(f"patchgen: anchor not unique ({count}): {old!r}")
            text = text.replace(old, new)
    return text


def main(src_root: str, release: str) -> None:
    for rel_path, edits in FILES.items():
        write_diff(src_root, rel_path, lambda text, edits=edits: patch_text(text, edits))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
