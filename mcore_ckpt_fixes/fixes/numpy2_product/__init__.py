"""numpy2-product: ``dist_checkpointing`` of Megatron-Core 0.12-0.15 runs under NumPy 2, which
removed ``np.product``.

Affected: Megatron-Core 0.12.0-0.15.x with NumPy 2 installed (0.12.x declares no NumPy bound;
0.13.0-0.15.x declare ``numpy<2.0.0``, which an environment that needs NumPy 2 for another package,
or an install without dependency resolution, does not keep). Three functions of
``megatron/core/dist_checkpointing`` call ``np.product``: the shard size of the fully parallel save
and load's exchange (``exchange_utils._shard_size``, every tensor of every save with
``--ckpt-fully-parallel-save``, Megatron-LM's default), the coverage check of flattened tensors
(``validation._validate_sharding_for_key_flattened``, the distributed optimizer's
``fully_sharded_model_space`` format) and ``ShardedTensor.local_coordinates`` (the zarr backend).
Each stops the save with ``AttributeError: `np.product` was removed in the NumPy 2.0 release. Use
`np.prod` instead.``. 0.16.0 calls ``np.prod``. No upstream report is known.

How (runtime/core.py): in those three modules the name ``np`` is bound to a module that is NumPy
with ``product`` as ``numpy.prod`` (the same function under its NumPy 1 alias); nothing else in
them, and nothing outside them, changes.
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
    targets=tuple(Target(m, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply") for m in MODULES),
)
