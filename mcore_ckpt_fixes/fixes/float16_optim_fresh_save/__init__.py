"""float16-optim-fresh-save: a checkpoint of the non-distributed mixed-precision optimizer saved
before its first step loads.

``Float16OptimizerWithFloat16Params`` (fp16 or bf16 without ``--use-distributed-optimizer``) creates
Adam's moments for a request only when loading: a save before the first successful step (an fp16 run
whose dynamic loss scale skips its first steps) writes none, and ``load_checkpoint``'s request asks
for them: ``KeyError: "optimizer.state.exp_avg.<param> from model not in state dict"`` on every rank.

Upstream: NVIDIA/Megatron-LM#602 (closed as stale); the same code in every release up to 0.19.2.
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "float16-optim-fresh-save"
MODULE = "megatron.core.optimizer.optimizer"
CLASS = "Float16OptimizerWithFloat16Params"

FIX = Fix(
    id=ID,
    summary=(
        "the non-distributed mixed-precision optimizer's checkpoint saved before its first step (fp16 runs "
        "whose first steps overflow) loads, and the resumed run trains on as the uninterrupted one"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM#602 (closed as stale): an fp16 run's save finds the optimizer state empty "
        "while the loss scale still searches; not fixed as of 0.19.2 (megatron/core/optimizer/optimizer.py)",
    ),
    targets=(Target(MODULE),),
)
