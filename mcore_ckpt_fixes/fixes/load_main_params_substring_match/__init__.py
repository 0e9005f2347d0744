"""load-main-params-substring-match: ``--load-main-params-from-ckpt`` gives each parameter the
state-dict key that names it, not every key its name is part of.

Affected: Megatron-Core 0.14.0-0.16.x (NVIDIA/Megatron-LM#3569; 0.17.0 matches with
``k.endswith(name)``), in ``megatron/core/optimizer/distrib_optimizer.py``.
``DistributedOptimizer.reload_model_params(state_dict)`` (``load_checkpoint`` with
``--no-load-optim --load-main-params-from-ckpt``) maps every parameter of its model chunks to the
checkpoint's tensor in ``_build_model_param_to_state_dict_param_map`` by ``name in k``: a parameter
whose name is part of another key matches several. Transformer Engine's grouped experts name one
tensor per local expert, ``linear_fc1.weight0`` .. ``weight{n-1}``: with 11 or more local experts
``weight1`` is part of ``weight10``, ``weight11``, ... and the load stops with ``AssertionError:
Parameter decoder.layers.0.mlp.experts.linear_fc1.weight1 has 3 matches in state dict``.

How (runtime/core.py): where the release's rule finds more than one key, the key equal to the
name, else the one key ending with ``"." + name`` (a state dict whose keys carry a prefix), is the
match; a single match, or none, or several with no one naming the parameter, stay the release's.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
