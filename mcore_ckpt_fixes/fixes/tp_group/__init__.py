"""tp-group: models built with explicit process groups can build their sharded state dict.

A model built with a ``ProcessGroupCollection`` and no ``parallel_state`` (how heterogeneous MIMO
builds its encoders) stops in ``sharded_state_dict()`` with ``AssertionError: tensor model parallel
group is not initialized``: ``MambaLayer`` and ``RADIOViTModel`` never store ``tp_group``, and
``MambaMixer`` calls its norm and checkpoint helper without groups. RADIO's patch embedder is also
built unsharded, so once the model has a group the save fails with ``Invalid access pattern``.

Upstream: NVIDIA/Megatron-LM#5486 (fixed in the 0.19.0 wheel).
Affected: Megatron-Core 0.16.0-0.18.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from ...engine.fix import Fix, Target

ID = "tp-group"
LAYER = "megatron.core.ssm.mamba_layer"
MIXER = "megatron.core.ssm.mamba_mixer"
RADIO = "megatron.core.models.vision.radio"

FIX = Fix(
    id=ID,
    summary="models built with explicit process groups (pg_collection) can build their sharded state dict",
    affected=">=0.16.0,<0.19.0",
    upstream=(
        'NVIDIA/Megatron-LM#5486 ("Thread process groups through training checkpoint paths": stores module-local '
        "TP groups on RADIO and SSM modules); fixed in the 0.19.0 wheel (mamba_layer.py, mamba_mixer.py, radio.py)",
    ),
    targets=(
        Target(LAYER, "probe_mamba_layer", "apply_mamba_layer"),
        Target(MIXER, "probe_mamba_mixer", "apply_mamba_mixer"),
        Target(RADIO, "probe_radio", "apply_radio"),
    ),
)
