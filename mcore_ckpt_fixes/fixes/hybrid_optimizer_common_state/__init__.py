"""hybrid-optimizer-common-state: a checkpoint of ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``)
loads its common state under torch's ``weights_only`` default.

The hybrid optimizer keeps its sub-optimizers' classes in every parameter group; a
``fully_reshardable`` save puts those groups into ``common.pt``, which ``dist_checkpointing`` reads
with ``torch.load``: since torch 2.6 a ``weights_only`` load, so every rank stops with
``UnpicklingError: Weights only load failed ... Unsupported global: GLOBAL torch.optim.adamw.AdamW``.
0.15-0.18 write such checkpoints (0.14 too, in its default ``fully_sharded_model_space``); 0.19 reads
an older release's ``common.pt`` the same way.

Upstream: not fixed as of 0.19.2 (reported as NVIDIA-NeMo/RL#1553).
Affected: Megatron-Core 0.14.0-0.19.2 but 0.17.0, with torch >= 2.6.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
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
    affected=">=0.14.0,<=0.19.2,!=0.17.0",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (megatron/core/dist_checkpointing/strategies/common.py)",
        "NVIDIA-NeMo/RL#1553: resume fails with 'Weights only load failed' when optimizer_cpu_offload is enabled",
    ),
    targets=(
        Target(
            MODULE,
            alias_sites=("megatron.core.dist_checkpointing.serialization",),
        ),
    ),
)
