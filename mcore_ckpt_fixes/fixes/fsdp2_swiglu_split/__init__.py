"""fsdp2-swiglu-split: a SwiGLU ``linear_fc1`` sharded by torch FSDP2 is written to ``torch_dist``
checkpoints with its gate (W) and up (V) halves in their places.

Affected: Megatron-Core 0.12.0-0.18.x (NVIDIA/Megatron-LM#5714; 0.19.0 gives
``apply_swiglu_sharded_factory`` the data-parallel group and a DP-shard branch), in
``megatron/core/transformer/mlp.py``.

Failure prevented: with ``--use-torch-fsdp2`` every parameter is a DTensor whose local tensor is a
contiguous slice of rows of the TP-local ``[W; V]`` weight (and bias). ``MLP.sharded_state_dict``
hands the ShardedTensor of that slice to ``apply_swiglu_sharded_factory``, which cuts the *slice*
in two and labels its first half W and its second half V. With DP=2 and TP=1, rank 0 holds all of
W and writes its second half where V's first half belongs; rank 1 writes V's first half where W's
second half belongs. The save and a resume in the same layout are exact (the same wrong map both
ways), but the checkpoint's global ``linear_fc1`` is scrambled: loading it unsharded, with another
data-parallel size or without FSDP2, or converting it, gives every such MLP mixed gate and up rows,
silently. The optimizer's ``exp_avg`` / ``exp_avg_sq`` go through the same factory.

How (runtime/core.py): ``MLP.sharded_state_dict`` is wrapped; for ``linear_fc1.weight`` and
``.bias`` whose parameter is a DTensor sharded along rows on one mesh dimension, the factory the
release built keeps its keys, replica index and merge, and gets a build function that places each
local row in the global ``[W; V]`` (the W rows of this TP rank, then the V rows), from the
DTensor's own mesh and placements and the release's description of the shard. Anything it does not
recognise keeps the release's factory.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "fsdp2-swiglu-split"
MODULE = "megatron.core.transformer.mlp"

FIX = Fix(
    id=ID,
    summary=(
        "torch FSDP2 (DTensor) SwiGLU linear_fc1: the checkpoint keeps W and V rows in their places "
        "(the release split each DP shard in two, scrambling the global tensor silently)"
    ),
    affected=">=0.12.0,<0.19.0",
    upstream=(
        "NVIDIA/Megatron-LM#5714 (Megatron-Core 0.19.0: apply_swiglu_sharded_factory takes the data-parallel "
        "group and maps an FSDP2 DP shard inside [W; V])",
    ),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
