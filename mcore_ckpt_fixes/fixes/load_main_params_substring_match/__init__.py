"""load-main-params-substring-match: ``--load-main-params-from-ckpt`` gives each parameter the
state-dict key that names it, not every key its name is part of.

``DistributedOptimizer.reload_model_params(state_dict)`` maps each parameter to the checkpoint's
tensor by ``name in k``: with Transformer Engine's grouped experts and 11 or more local experts,
``weight1`` is part of ``weight10``, ``weight11``, ... and the load stops with ``AssertionError:
Parameter ...linear_fc1.weight1 has 3 matches in state dict``.

Upstream: NVIDIA/Megatron-LM#3569 (0.17.0 matches with ``k.endswith(name)``).
Affected: Megatron-Core 0.14.0-0.16.x.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "load-main-params-substring-match"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "--load-main-params-from-ckpt matches each parameter to the state-dict key that names it "
        "(grouped experts' weight1 also matched weight10, weight11: the load stopped)"
    ),
    affected=">=0.14.0,<0.17.0",
    upstream=("NVIDIA/Megatron-LM#3569 (Megatron-Core 0.17.0 matches with k.endswith(name))",),
    targets=(Target(MODULE),),
)
