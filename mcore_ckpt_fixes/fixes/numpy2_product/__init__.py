"""numpy2-product: ``dist_checkpointing`` of Megatron-Core 0.12-0.15 runs under NumPy 2, which
removed ``np.product``.

Three functions of ``megatron/core/dist_checkpointing`` call ``np.product``: the fully parallel save
and load's shard size (every ``torch_dist`` save with ``--ckpt-fully-parallel-save``, Megatron-LM's
default), the coverage check of flattened tensors and ``ShardedTensor.local_coordinates``. Under
NumPy 2 each stops the save with ``AttributeError`` (0.13.0-0.15.x declare ``numpy<2.0.0``, which an
environment that needs NumPy 2 elsewhere does not keep).

Upstream: not reported; 0.16.0 calls ``np.prod``.
Affected: Megatron-Core 0.12.0-0.15.x with NumPy 2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "numpy2-product"
# The modules that call np.product, and the function of each the probe runs.
MODULES = (
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.validation",
    "megatron.core.dist_checkpointing.mapping",
)

FIX = Fix(
    id=ID,
    summary=(
        "dist_checkpointing of 0.12-0.15 saves and loads under NumPy 2 (np.product, removed in NumPy 2.0, "
        "stopped every fully parallel save)"
    ),
    affected=">=0.12.0,<0.16.0",
    upstream=("not reported upstream; Megatron-Core 0.16.0 calls np.prod",),
    targets=tuple(Target(m) for m in MODULES),
)
