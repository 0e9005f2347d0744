"""fully-reshardable-buckets: a distributed optimizer whose gradient buffer has several buckets saves
every parameter's own state in ``fully_reshardable`` format.

Affected: Megatron-Core 0.15.0-0.19.2 (fixed on upstream main by NVIDIA/Megatron-LM#5077), in
``DistributedOptimizer.sharded_param_state_fully_reshardable``
(``megatron/core/optimizer/distrib_optimizer.py``). ``get_parameter_state_dp_zero`` gathers the
main parameters and moments into one world tensor per buffer with the buckets back to back (the
padding that ends each bucket dropped); ``sharded_param_state_fully_reshardable`` then cuts each
parameter's state out of it at the parameter's position in the *padded* gradient buffer
(``param_index_map``). Every parameter after the first bucket is saved from the wrong offset (another
parameter's values, or padding), the last ones are zero-filled with only a log warning, and the save
says nothing else. A buffer has several buckets whenever ``overlap_grad_reduce`` is on with a bucket
size smaller than the model (Megatron-LM's ``--overlap-grad-reduce``, ``--ddp-bucket-size``), and a
parameter sits at a different place in the two layouts whenever a bucket ends padded (it is padded to
a multiple of the data-parallel size, and more). The load cuts each parameter's state out of the
checkpoint correctly, so it restores the wrong values: the resumed run silently diverges, and the
checkpoint is wrong for any other layout too.

How (runtime/core.py): inside ``sharded_param_state_fully_reshardable`` the gathered world tensors are
laid out as the gradient buffer is (each bucket's values at its offset, the padding zero), which is
where the release's slicing looks; everything else is the release's code. Replaced: that method and
``DistributedOptimizer.get_parameter_state_dp_zero``, which lays its result out so only when that
optimizer's fully_reshardable save called it, in that thread (every other caller gets the release's
layout). Only where a buffer's
buckets really sit at different places in the two layouts. Checkpoints the release wrote with one
bucket per buffer are unchanged, byte for byte.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "fully-reshardable-buckets"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "A distributed optimizer whose gradient buffer has several buckets saves each parameter's own "
        "state in fully_reshardable format (was another parameter's, silently)"
    ),
    affected=">=0.15.0,<=0.19.2",
    upstream=("NVIDIA/Megatron-LM#5077 (fixed on main, not in a release as of 0.19.2)",),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
