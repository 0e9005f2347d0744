"""chained-optim-main-params-split: ``--load-main-params-from-ckpt`` gives every sub-optimizer of a
``ChainedOptimizer`` its own model chunks of the checkpoint.

Affected: Megatron-Core 0.14.0-0.17.x (NVIDIA/Megatron-LM#3676; 0.18.0 splits by chunk identity), in
``megatron/core/optimizer/optimizer.py``. ``ChainedOptimizer.reload_model_params(state_dict)``, which
``megatron.training.checkpointing.load_checkpoint`` calls with ``--no-load-optim
--load-main-params-from-ckpt`` on bf16/fp16 runs, hands each sub-optimizer the part of the
checkpoint ``_split_state_dict`` chose for it. With one model chunk only the first sub-optimizer
(dense parameters) gets it: the others (the expert optimizer of an MoE model) rebuild their fp32
main parameters from the bf16 model parameters, silently dropping the checkpoint's fp32 precision
of every expert parameter. With several chunks (virtual pipeline) chunks are handed out by a
running offset although every sub-optimizer covers all of them: the expert optimizer asks for
``model{N}`` past the last chunk and the load stops (``AssertionError: Wrong state_dict format``).

How (runtime/core.py): each sub-optimizer gets the checkpoint's entries of its own
``model_chunks``, found by identity among the ``ChainedOptimizer``'s chunks (renumbered from 0 as
the sub-optimizer counts them); a call the fix does not recognise (a sub-optimizer without
``model_chunks``, a chunk the chained optimizer does not hold, a checkpoint without the chunk keys)
gets the release's split.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
