"""fully-reshardable-buckets: a distributed optimizer whose gradient buffer has several buckets saves
every parameter's own state in ``fully_reshardable`` format.

``sharded_param_state_fully_reshardable`` gathers the main parameters and moments with the buckets
back to back (padding dropped), then cuts each parameter out at its offset in the *padded* buffer.
With several buckets (``--overlap-grad-reduce`` and a bucket size smaller than the model) every
parameter after the first bucket is saved from the wrong place, the last ones zero-filled with only a
log warning. The load restores those values: the resumed run silently diverges, and the checkpoint
is wrong for any other layout too.

Upstream: NVIDIA/Megatron-LM#5077 (fixed on main, not in a release as of 0.19.2).
Affected: Megatron-Core 0.15.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
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
    targets=(Target(MODULE),),
)
