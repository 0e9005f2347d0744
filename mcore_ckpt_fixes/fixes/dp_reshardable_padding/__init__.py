"""dp-reshardable-padding: the distributed optimizer saves and loads in ``dp_reshardable`` format
(Megatron-LM's default) whatever part of a bucket's end padding a data-parallel rank holds.

Affected: Megatron-Core 0.15.0-0.19.2 (NVIDIA/Megatron-LM#6191 and #5898, both open), in
``DistributedOptimizer.sharded_param_state_dp_reshardable``
(``megatron/core/optimizer/distrib_optimizer.py``). Each bucket is saved as one tensor of the bucket's
unpadded size; each rank describes its shard of the bucket as its parameters' pieces plus padding
pieces that fill the gaps, the gaps at the bucket's end included. Two shapes of the end padding break
the save (and the load's request, built by the same method):

* a rank whose shard of a bucket holds no parameter at all (the bucket-end padding covers it: a small
  bucket at a large data-parallel size, or any bucket under 65536 / DP elements with
  ``--ddp-pad-buckets-for-high-nccl-busbw``) stops with ``AssertionError: empty bucket encountered``,
  its peers waiting for it in the save's collectives (#6191);
* a rank whose shard holds the end of a bucket that ends before the bucket's unpadded size (the
  bucket closed by a tied embedding or MTP layer with PP > 1: its unpadded size is the embedding's
  aligned start) describes padding up to the end of its shard, past the end of the bucket's tensor:
  torch DCP rejects the global plan (``ValueError: Failed to validate global plan``, newer torch
  adding ``out of bounds chunk``) after the other ranks wrote their files, leaving an iteration
  directory without metadata (#5898).

How (runtime/core.py): the state the method describes (``get_parameter_state_dp_reshardable``'s, for
that optimizer's call only) gets padding pieces of its own where the release's would go wrong: the
end gap of a shard that runs past the unpadded size ends at it; a shard that holds no parameter but
lies within the unpadded size is one padding piece; a shard wholly in the end padding gets an empty
padding marker (nothing saved, nothing loaded). The load discards padding pieces as the release
does. Where the release's pieces are right, nothing is added: checkpoints it can write are unchanged,
byte for byte.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dp-reshardable-padding"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "The distributed optimizer saves dp_reshardable (Megatron-LM's default) when a rank's shard of a "
        "bucket is all padding or ends past the bucket's unpadded size (was an AssertionError, or a DCP "
        "plan error that left a partial checkpoint)"
    ),
    affected=">=0.15.0,<=0.19.2",
    upstream=("NVIDIA/Megatron-LM#6191 (open)", "NVIDIA/Megatron-LM#5898 (open)"),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
