"""model-load-fallback: ``load_checkpoint`` no longer leaves model weights the checkpoint lacks at
their initial values, silently.

``megatron.training``'s ``load_checkpoint`` loads each model chunk strict; where that fails it
retries with ``strict=False`` (meant for Transformer Engine's ``_extra_state``) and only prints
``load_return: None``. A checkpoint without some of the model's weights (a legacy ``torch`` checkpoint
of a tied model loaded with ``--untie-embeddings-and-output-weights``, a converted checkpoint that
lost a key, ``torch_dist`` with ``--dist-ckpt-strictness ignore_all``) trains on from random weights.
The fix refuses such a load with one error naming the weights, or names them in a warning where the
strictness drops missing keys by choice.

Upstream: not fixed as of 0.19.2 (Megatron-Bridge's copy: NVIDIA-NeMo/Megatron-Bridge#6032, closed).
Affected: Megatron-Core 0.17.0-0.19.2 (``megatron/training`` ships in the wheel from 0.17.0; a
checkout of an older release, core_v0.13.0 on, is decided by the probe). The rest is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "model-load-fallback"
MODULE = "megatron.training.checkpointing"
FUNCTION = "load_checkpoint"
NESTED = "load_model_state_dict"  # the helper nested in load_checkpoint that retries non-strict

FIX = Fix(
    id=ID,
    summary=(
        "load_checkpoint refuses a model load that would leave weights the checkpoint lacks at their "
        "initial values (named in one error; a warning under --dist-ckpt-strictness log_all / ignore_all / "
        "return_all), where it retried non-strict and went on silently"
    ),
    affected=">=0.17.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (load_model_state_dict in megatron/training/checkpointing.py)",
        "NVIDIA-NeMo/Megatron-Bridge#6032: the same retry in Megatron-Bridge (closed, not merged)",
    ),
    targets=(Target(MODULE),),
)
