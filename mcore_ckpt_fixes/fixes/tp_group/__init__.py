"""tp-group: models built with explicit process groups can build their sharded state dict.

Affected: Megatron-Core 0.16.0 - 0.18.x; fixed in the 0.19.0 wheel (measured). The upstream change
is NVIDIA/Megatron-LM#5486 ("Thread process groups through training checkpoint paths": store
module-local TP groups on RADIO and SSM modules so sharded checkpointing does not fall back to the
global TP group).

Failure prevented: a model built with a ``ProcessGroupCollection`` and no ``parallel_state`` (how
heterogeneous MIMO builds its encoders) dies in ``sharded_state_dict()`` with
``AssertionError: tensor model parallel group is not initialized``, because

* ``MambaLayer.__init__`` and ``RADIOViTModel.__init__`` never store ``self.tp_group``, so
  ``MegatronModule.sharded_state_dict`` falls back to ``parallel_state``;
* ``RADIOViTModel`` builds its patch embedder (a ``ColumnParallelLinear``) without ``tp_group``:
  with ``parallel_state`` uninitialised the embedder is quietly built unsharded (full size on every
  rank), and once the model has a ``tp_group`` the save fails with ``Invalid access pattern`` for
  ``embedder.weight``;
* ``MambaMixer`` leaves its ``ExtendedRMSNorm`` without a group and calls
  ``make_sharded_tensors_for_checkpoint`` (the name bound in ``megatron.core.ssm.mamba_mixer``)
  without ``tp_group`` / ``dp_cp_group``.

How: wrap the three constructors so the group from ``pg_collection`` (found by binding the call to
the original signature: its position differs between releases) is stored where upstream 0.19 stores
it; for the two calls made without a group, a context variable carries the caller's groups into a
replacement bound *only* in the namespace of the module that makes the call. A model built the
classic way gets the same groups ``parallel_state`` would have given, so it behaves identically.
"""

from ...engine.fix import Fix, Target

ID = "tp-group"
LAYER = "megatron.core.ssm.mamba_layer"
MIXER = "megatron.core.ssm.mamba_mixer"
RADIO = "megatron.core.models.vision.radio"
_PATCH = f"{__name__}.runtime.core:"

FIX = Fix(
    id=ID,
    summary="models built with explicit process groups (pg_collection) can build their sharded state dict",
    affected=">=0.16.0,<0.19.0",
    upstream=(
        'NVIDIA/Megatron-LM#5486 ("Thread process groups through training checkpoint paths": stores module-local '
        "TP groups on RADIO and SSM modules); fixed in the 0.19.0 wheel (mamba_layer.py, mamba_mixer.py, radio.py)",
    ),
    targets=(
        Target(LAYER, _PATCH + "probe_mamba_layer", _PATCH + "apply_mamba_layer"),
        Target(MIXER, _PATCH + "probe_mamba_mixer", _PATCH + "apply_mamba_mixer"),
        Target(RADIO, _PATCH + "probe_radio", _PATCH + "apply_radio"),
    ),
)
