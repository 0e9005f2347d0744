"""factory-merges-non-strict: a ``torch_dist`` load that tolerates keys the checkpoint lacks loads a
model whose missing tensors come from ``ShardedTensorFactory`` s.

With ``--dist-ckpt-strictness log_all`` / ``ignore_all`` / ``return_*`` (``strict`` of
``dist_checkpointing.load``) the requested keys the checkpoint lacks are left out of the request,
but not out of the factories: the load stops in ``apply_factory_merges`` with ``ValueError:
Different dict keys encountered``. A SwiGLU ``linear_fc1`` is such a factory, so adding a layer the
checkpoint does not have (a multi-token-prediction layer, adapters) fails under the very strictness
meant for it. The fix merges only the factories whose tensors were loaded.

Upstream: not fixed as of 0.19.2 (AMD-AGI/Primus patches it: apply_factory_merges_tolerant).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "factory-merges-non-strict"
MODULE = "megatron.core.dist_checkpointing.serialization"
FUNCTION = "apply_factory_merges"

FIX = Fix(
    id=ID,
    summary=(
        "a torch_dist load under a strictness that tolerates keys missing from the checkpoint (log_all, "
        "ignore_all, return_*) loads a model whose missing tensors come from factories (SwiGLU linear_fc1 of an "
        "added layer): the load stopped in apply_factory_merges"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (serialization.load merges every factory)",
        "AMD-AGI/Primus: apply_factory_merges_tolerant (the same failure, patched there)",
    ),
    targets=(Target(MODULE),),
)
