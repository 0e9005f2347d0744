"""expert-keys: every expert-parallel rank writes its experts under their global index (fsdp_dtensor).

Under EP > 1, ``handle_experts_in_state_dict`` gives expert weights their global index but not the
biases of TE grouped experts (``linear_fc1.bias{i}``): every EP rank writes the same keys, DCP keeps
one copy, and the other EP ranks load its biases, silently. ``num_experts=None`` deletes every expert
key, silently. A single grouped tensor (0.18+) trips ``Failed to parse expert index from key`` or, as
a grouped bias, is written by every EP rank under one key; callers that preprocess themselves call
``handle_grouped_experts_in_state_dict`` (exported here) afterwards.

Upstream: not fixed as of 0.19.2 (closest: NVIDIA/Megatron-LM#6600, grouped tensors only).
Affected: Megatron-Core 0.16.0-0.19.2 (also Megatron-Bridge; NeMo 2 reported as not covered).
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "expert-keys"
MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
NAMES = ("get_expert_index_from_key", "handle_experts_in_state_dict", "expert_param_local_key")
# Modules known to bind these names with ``from ... import`` (the engine rebinds every loaded module).
ALIAS_SITES = ("megatron.training.checkpointing", "megatron.core.optimizer.distrib_optimizer")
# Its fsdp_dtensor save and load call Megatron-FSDP's uneven-DTensor preprocessing through this name;
# only this binding is replaced (Megatron-FSDP's own fully_shard path has no expert parallelism).
TRAINING = "megatron.training.checkpointing"
UNEVEN = "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor"
# Megatron-Bridge's ``preprocess_fsdp_dtensor_state_dict`` (its fsdp_dtensor save and load) calls the
# same preprocessing through its own binding, imported by name when Bridge is: replaced there too.
# Gated by Megatron-Core's version: the missing grouped handling is Megatron-Core's.
BRIDGE = "megatron.bridge.training.checkpointing"
# NeMo 2's strategy (nemo-toolkit < 3.0) preprocesses fsdp_dtensor checkpoints itself and never calls
# handle_experts_in_state_dict: not covered; declared so that status says so where NeMo is installed
# (nemo-toolkit 3.0 has no such module: not applicable).
NEMO = "nemo.lightning.pytorch.strategies.megatron_strategy"


FIX = Fix(
    id=ID,
    summary="fsdp_dtensor expert biases get global indices under EP; num_experts=None and grouped tensors handled",
    affected=">=0.16.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2: megatron/core/transformer/fsdp_dtensor_checkpoint.py "
        "handle_experts_in_state_dict renames expert weights only",
        "NVIDIA/Megatron-LM#6600 (closest upstream issue: EP with single grouped [E_local, ...] expert tensors "
        "under Megatron-FSDP v2, the grouped-tensor part only; it does not cover fsdp_dtensor's expert keys)",
    ),
    targets=(
        Target(MODULE, alias_sites=ALIAS_SITES),
        Target(TRAINING, "probe_training", "apply_training"),
        Target(BRIDGE, f"{__name__}.runtime.bridge:probe_bridge", f"{__name__}.runtime.bridge:apply_bridge"),
        Target(
            NEMO,
            "probe_nemo",
            "apply_nemo",
            package="nemo-toolkit",
            affected="<3.0.0",
        ),
    ),
)


def __getattr__(name):
    # handle_grouped_experts_in_state_dict is the documented entry point for callers that run the
    # uneven-DTensor preprocessing themselves (docs/fixes/expert-keys.md, docstring above): resolved on first use, so
    # that importing the declaration imports none of the implementation.
    if name == "handle_grouped_experts_in_state_dict":
        from .runtime.keys import handle_grouped_experts_in_state_dict

        return handle_grouped_experts_in_state_dict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
