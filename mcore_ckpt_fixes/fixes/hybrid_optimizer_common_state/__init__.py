"""hybrid-optimizer-common-state: a checkpoint of ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``)
loads its common state under torch's ``weights_only`` default.

Affected: Megatron-Core 0.15.0-0.19.2 but 0.17.0 (which read the file with ``weights_only=False``),
with torch >= 2.6 (not fixed upstream as of 0.19.2; reported as NVIDIA-NeMo/RL#1553). The hybrid optimizer keeps its sub-optimizers' classes in every parameter group
(``cpu_optimizer_cls``, ``gpu_optimizer_cls``: torch's ``AdamW``, Transformer Engine's or Apex's
``FusedAdam``). The distributed optimizer's ``fully_reshardable`` save puts those groups into the
checkpoint's common state, ``common.pt``, and ``dist_checkpointing`` reads that file with
``torch.load(path, map_location='cpu')``: since torch 2.6 that means ``weights_only=True``, which
refuses any class it was not told about. The load stops on every rank with ``UnpicklingError:
Weights only load failed ... Unsupported global: GLOBAL torch.optim.adamw.AdamW``. 0.15-0.18 write
such checkpoints; 0.19 keeps its own common state in DCP, but reads a ``common.pt`` of an older
release the same way.

How (runtime/core.py): the release's common-state load runs with the optimizer classes Megatron-Core
can put there allowed (``torch.serialization.safe_globals``): the ones ``megatron.core.optimizer``
builds the hybrid optimizer from, and torch's own Adam, AdamW and SGD. Nothing else is allowed, the
file is read once as before, nothing changes on disk.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-common-state"
MODULE = "megatron.core.dist_checkpointing.strategies.common"

FIX = Fix(
    id=ID,
    summary=(
        "A torch_dist checkpoint of HybridDeviceOptimizer (--optimizer-cpu-offload) loads its common "
        "state with torch >= 2.6 (the optimizer classes in its param groups were refused: UnpicklingError)"
    ),
    affected=">=0.15.0,<=0.19.2,!=0.17.0",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (megatron/core/dist_checkpointing/strategies/common.py)",
        "NVIDIA-NeMo/RL#1553: resume fails with 'Weights only load failed' when optimizer_cpu_offload is enabled",
    ),
    targets=(
        Target(
            MODULE,
            f"{__name__}.runtime.core:probe",
            f"{__name__}.runtime.core:apply",
            alias_sites=("megatron.core.dist_checkpointing.serialization",),
        ),
    ),
)
