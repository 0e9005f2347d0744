"""dtensor-placement: describe a DTensor parameter to dist_checkpointing from its own mesh and placements.

``make_tp_sharded_tensor_for_checkpoint`` and ``make_sharded_tensor_for_checkpoint`` describe a DTensor
parameter (torch FSDP2, HSDP, a library's own expert mesh) with offsets from the dense data-parallel
group they are handed, whatever the DTensor's mesh says, and ``SequentialMLP`` marks expert-DP ranks
but the first as replicas. Under EP an expert weight gets a wrong global shape and the save fails
(``Invalid access pattern``); an HSDP parameter is written with a wrong global shape, which any other
layout then fails on; uneven shards get per-rank global shapes.

Upstream: not fixed as of 0.19.2 (closest: NVIDIA/Megatron-LM#4553, fixed by #4664, on fsdp_dtensor).
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dtensor-placement"
UTILS = "megatron.core.utils"
EXPERTS = "megatron.core.transformer.moe.experts"

FIX = Fix(
    id=ID,
    summary="dist_checkpointing offsets of DTensor parameters come from their own mesh and placements, not the dense DP group",
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of 0.19.2",
        "closest upstream: NVIDIA/Megatron-LM#4553 (Megatron-FSDP checkpoint fails with tensor and expert "
        "parallelism; fixed by NVIDIA/Megatron-LM#4664, which keeps the TP placement of split GDN tensors so they "
        "are not validated against a DP-only mesh). Same class of bug, DTensor checkpoint metadata taken from the "
        "wrong mesh under EP, on Megatron-FSDP's fsdp_dtensor path; this fix covers dist_checkpointing's helpers "
        "(make_[tp_]sharded_tensor_for_checkpoint) and SequentialMLP, which no upstream change addresses",
    ),
    targets=(
        Target(
            UTILS,
            "probe_utils",
            "apply_utils",
            alias_sites=(
                "megatron.core.transformer.utils",
                "megatron.core.tensor_parallel.layers",
                "megatron.core.models.common.language_module.language_module",
                "megatron.core.transformer.moe.shared_experts",
                "megatron.core.transformer.multi_latent_attention",
                "megatron.core.transformer.multi_token_prediction",
                "megatron.core.optimizer.optimizer",
                "megatron.core.ssm.mamba_mixer",
            ),
        ),
        Target(EXPERTS, "probe_sequential_mlp", "apply_sequential_mlp"),
    ),
)
