"""tp-group as upstream writes it: the lines the source diffs add to a 0.16-0.18 release.

Upstream's own shape of the fix (what 0.19 does): ``MambaLayer`` and ``RADIOViTModel`` keep
``pg_collection.tp`` as ``self.tp_group``, ``MambaMixer`` hands its group to its gated norm and
passes ``tp_group`` / ``dp_cp_group`` to ``make_sharded_tensors_for_checkpoint``, and RADIO builds
its patch embedder over the model's TP group. The monkeypatch (``runtime/core.py``) has the same effect
from outside the classes; tests/patches checks that the patched source satisfies every probe of
this fix and round-trips with the monkeypatch off, so the two cannot drift apart silently.

    python tools/patchgen tp-group SRC_ROOT RELEASE > patches/tp-group/RELEASE.patch
"""

from __future__ import annotations

from ....sourcediff import Replace

# Each anchor must occur exactly once; ``{indent}`` edits (RADIO's embedder arguments, whose
# indentation differs between releases) apply at every occurrence.
EDITS = {
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


def source_edits(release: str) -> list:
    """The same edits on every affected release line (0.16, 0.17, 0.18)."""
    return [
        Replace(path, old, new, every="{indent}" in new)
        for path, edits in EDITS.items()
        for old, new in edits
    ]
