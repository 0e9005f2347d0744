"""chained-optim-main-params-split: ``--load-main-params-from-ckpt`` gives every sub-optimizer of a
``ChainedOptimizer`` its own model chunks of the checkpoint.

``ChainedOptimizer.reload_model_params(state_dict)`` (``load_checkpoint`` with ``--no-load-optim
--load-main-params-from-ckpt``) hands each sub-optimizer the part ``_split_state_dict`` chose. With one
model chunk the expert optimizer of an MoE model gets nothing and rebuilds its fp32 main parameters
from the bf16 model, silently dropping the checkpoint's precision; with several chunks (virtual
pipeline) it asks for ``model{N}`` past the last chunk and the load stops (``Wrong state_dict format``).

Upstream: NVIDIA/Megatron-LM#3676 (0.18.0 splits by chunk identity).
Affected: Megatron-Core 0.14.0-0.17.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "chained-optim-main-params-split"
MODULE = "megatron.core.optimizer.optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "--load-main-params-from-ckpt gives every sub-optimizer (dense and expert) the checkpoint's "
        "fp32 parameters of its own model chunks (the expert optimizer kept the bf16 rounding)"
    ),
    affected=">=0.14.0,<0.18.0",
    upstream=("NVIDIA/Megatron-LM#3676 (fixed in Megatron-Core 0.18.0: ChainedOptimizer splits by chunk identity)",),
    targets=(Target(MODULE),),
)
